"""The declaring half of rl_runtime's typed configuration (rl_runtime.config parses and
prints): settings as dataclass fields (`option`, `section`, `choice`, their metadata as
`Bounds`), the leaves a config's dataclasses make, and turning a flag's or a variable's text
into a field's type. Kept apart from the parser by topic; the metadata keys are described in
rl_runtime.config.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_BOUND_KEYS = ("ge", "gt", "le", "lt", "choices")


class ConfigError(ValueError):
    """A flag, environment variable or preset value that does not fit the config."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a value must satisfy: numeric bounds and/or a set of choices (a sequence, or a
    function returning one, for registries that are imported only when checked)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None

    def describe(self) -> str:
        """`>= 1`, `> 0 and < 1`, ...: appended to the help text."""
        parts = [
            f"{op} {_num(bound)}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        return " and ".join(parts)

    def listed(self) -> list[Any] | None:
        if self.choices is None:
            return None
        return list(self.choices() if callable(self.choices) else self.choices)

    def problem(self, value: Any) -> str | None:
        """Why `value` does not fit, or None."""
        choices = self.listed()
        if choices is not None and value not in choices:
            return f"expected one of {choices}"
        if isinstance(value, int | float) and not isinstance(value, bool):
            for bound, holds in (
                (self.ge, operator.ge),
                (self.gt, operator.gt),
                (self.le, operator.le),
                (self.lt, operator.lt),
            ):
                if bound is not None and not holds(value, bound):
                    return f"must be {self.describe()}"
        return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    flag: str | None = None,
    items: Sequence[str] = (),
    **kwargs: Any,
) -> Any:
    """A setting: `dataclasses.field` with its help text, bounds or choices (checked by
    `validate`; None always passes for an optional field), short names, and a mutable default
    made safe."""
    metadata: dict[str, Any] = {"help": help or " "}
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    metadata |= {k: v for k, v in bounds.items() if v is not None}
    if flag is not None:
        metadata["flag"] = flag
    if items:
        metadata["items"] = tuple(items)
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(
            default_factory=lambda: type(value)(value), metadata=metadata, **kwargs
        )
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def section(cls: type, help: str = "") -> Any:
    """A nested section: a field whose default is `cls()`; its settings join the tree."""
    return dataclasses.field(default_factory=cls, metadata={"help": help or cls.__name__})


def choice(options: Mapping[str, type], *, by: str, help: str = "") -> Any:
    """A section whose dataclass the setting named `by` picks among `options` (the trainer's,
    by `backend`). `by`'s choices become the option names."""
    return dataclasses.field(
        default=None, metadata={"help": help or "section", "options": dict(options), "select": by}
    )


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One setting: where it sits (`path`), its type, default and metadata."""

    path: tuple[str, ...]
    type: Any
    default: Any
    help: str
    bounds: Bounds = Bounds()
    short: str | None = None
    items: tuple[str, ...] = ()
    picked_by: tuple[str, str] | None = None  # (the selecting setting, this option's name)

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return flag_name(self.dotted)

    @property
    def display(self) -> str:
        """The flag a message names: the short one where there is one."""
        return flag_name(self.short) if self.short else self.flag

    def names(self) -> Iterator[tuple[str, int | None]]:
        """The names this setting answers to (dotted, short, items) and the item each sets."""
        yield self.dotted, None
        if self.short:
            yield self.short, None
        for i, item in enumerate(self.items):
            yield item, i


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def setting_key(text: str) -> str:
    """`--trainer.optim.max-grad-norm` or `max-grad-norm` -> the key `trainer.optim.max_grad_norm`."""
    return text.removeprefix("--").replace("-", "_")


# ---------------------------------------------------------------------------------- the tree


def field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_section(f: dataclasses.Field, tp: Any, root: bool) -> bool:
    return dataclasses.is_dataclass(tp) and (root or "help" in f.metadata)


def is_setting(f: dataclasses.Field, root: bool) -> bool:
    return "help" in f.metadata or root


def leaves(cfg: Any) -> list[Leaf]:
    """The settings of a config instance (its choices already made), in declaration order."""
    out: list[Leaf] = []
    _walk(cfg, (), None, out, root=True)
    shorts = [k for leaf in out for k, _ in leaf.names() if "." not in k]
    dupes = sorted({k for k in shorts if shorts.count(k) > 1})
    if dupes:
        raise ConfigError(f"{type(cfg).__name__}: short names must be unique in a tree: {dupes}")
    return out


def _walk(
    obj: Any,
    path: tuple[str, ...],
    picked_by: tuple[str, str] | None,
    out: list[Leaf],
    *,
    root: bool = False,
) -> None:
    hints = field_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp, here = getattr(obj, f.name), hints[f.name], (*path, f.name)
        if "options" in f.metadata:
            name = next(k for k, c in f.metadata["options"].items() if isinstance(value, c))
            _walk(value, here, (f.metadata["select"], name), out)
        elif is_section(f, tp, root):
            _walk(value, here, picked_by, out)
        elif is_setting(f, root):
            meta = dict(f.metadata)
            base, _ = strip_optional(tp)
            if get_origin(base) is Literal:  # checked as choices, so errors name the source
                meta.setdefault("choices", get_args(base))
            bounds = Bounds(**{k: meta[k] for k in _BOUND_KEYS if k in meta})
            short = meta.get("flag", f.name)
            help_text = meta.get("help", "").strip()
            out.append(
                Leaf(here, tp, value, help_text, bounds, short, meta.get("items", ()), picked_by)
            )


def section_help(cfg: Any, path: Sequence[str]) -> str:
    """What the section at `path` is for, as declared (`section(cls, help)`, or a nested
    dataclass field's help): `--help` shows it above the section's flags. "" for the root and
    for a section declared without one."""
    found = ""
    for name in path:
        f = next(f for f in dataclasses.fields(cfg) if f.name == name)
        cfg = getattr(cfg, name)
        found = f.metadata.get("help", "")
    return "" if found in (type(cfg).__name__, "section") else found


def choice_fields(cls: type) -> dict[tuple[str, ...], dataclasses.Field]:
    """The choice fields of the tree `cls` (at the root: choices do not nest)."""
    return {(f.name,): f for f in dataclasses.fields(cls) if "options" in f.metadata}


def skeleton(cls: type[T], picks: Mapping[tuple[str, ...], str]) -> T:
    """`cls()` with each choice section set to the default instance of its pick."""
    cfg = cls()
    for path, f in choice_fields(cls).items():
        object.__setattr__(cfg, path[-1], f.metadata["options"][picks[path]]())
    return cfg


def all_picks(cls: type) -> list[dict[tuple[str, ...], str]]:
    fields = choice_fields(cls)
    names = [list(f.metadata["options"]) for f in fields.values()]
    return [dict(zip(fields, combo, strict=True)) for combo in itertools.product(*names)]


# ---------------------------------------------------------------------------------- values


def strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(get_args(tp)):
            return args[0], True
    return tp, False


def item_type(tp: Any) -> Any:
    base, _ = strip_optional(tp)
    return get_args(base)[0]


def convert(value: str, tp: Any, where: str, about: str = "", bounds: Bounds = Bounds()) -> Any:
    """Turn a string from the command line or environment into a value of type `tp`; one that
    does not read is a `ConfigError` naming `where` (`environment GEO3K_NUM_GPUS=banana`), what
    the setting is (`about`, its help) and what it takes, in words (`a whole number >= 0`)."""
    base, _ = strip_optional(tp)
    known = get_origin(base) in (list, tuple, Literal) or base in (bool, int, float, str)
    if not known:
        raise ConfigError(f"{where}: unsupported config type {tp!r}")
    try:
        return _read(value, tp)
    except ValueError:
        what = f"{about}; takes" if about else "takes"
        raise ConfigError(f"{where}: {what} {takes(tp, bounds)}") from None


def _read(value: str, tp: Any) -> Any:
    base, optional = strip_optional(tp)
    if optional and value.strip().lower() in {"none", "null"}:
        return None
    if base is bool:
        v = value.strip().lower()
        if v in _TRUE or v in _FALSE:
            return v in _TRUE
        raise ValueError(value)
    if get_origin(base) is Literal:
        return value  # its choices are the setting's bounds (`validate`)
    if get_origin(base) in (list, tuple):
        (item,) = get_args(base)[:1]
        items = [_read(p, item) for p in value.replace(",", " ").split() if p]
        return items if get_origin(base) is list else tuple(items)
    return base(value)


_WORDS = {
    bool: "1 or 0 (also true/false, yes/no, on/off)",
    int: "a whole number",
    float: "a number",
}


def takes(tp: Any, bounds: Bounds = Bounds()) -> str:
    """What a setting of type `tp` takes, in words: `a whole number >= 0`, `a number or none`."""
    base, optional = strip_optional(tp)
    if get_origin(base) is Literal:
        text = "one of " + ", ".join(map(str, get_args(base)))
    elif get_origin(base) in (list, tuple):
        item = _WORDS.get(get_args(base)[0], "a word").removeprefix("a ")
        text = f"{item}s separated by commas or spaces"
    else:
        text = _WORDS.get(base, "text")
    if bounds.describe():
        text += f" {bounds.describe()}"
    return f"{text}, or none" if optional else text
