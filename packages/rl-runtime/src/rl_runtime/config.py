"""Typed configuration: nested dataclasses -> command-line flags, then environment, then defaults.

An app describes its whole configuration as one dataclass whose fields are dataclasses (the
sections). Every leaf field becomes a flag named after it (`num_rollout` -> `--num-rollout`), so
leaf names must be unique across sections. The help text comes from `field(metadata={"help"})`.

Precedence, highest first: command-line flag, environment variable (the app passes the mapping
and the aliases; this module never reads `os.environ`), preset, dataclass default.

Every value is checked where it is parsed, before anything starts: a field declares its range
and choices once, next to its default (`option(8, "...", ge=1)`); a float is always finite; a
section (or the whole config) may add a `check()` method for combinations of fields. A bad
value is a `ConfigError` whose one-line message names the flag, environment variable or preset
it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import operator
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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

    def problem(self, value: Any) -> str | None:
        """Why `value` does not fit, or None."""
        if self.choices is not None:
            choices = list(self.choices() if callable(self.choices) else self.choices)
            if value not in choices:
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
    **kwargs: Any,
) -> Any:
    """`dataclasses.field` with a help text, the value's bounds or choices (checked by
    `validate`; None always passes for an optional field), and a mutable default made safe."""
    metadata = {"help": help, "bounds": Bounds(ge, gt, le, lt, choices)}
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(
            default_factory=lambda: type(value)(value), metadata=metadata, **kwargs
        )
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One configurable value: where it sits (`section.name`) and its type."""

    section: str | None
    name: str
    type: Any
    default: Any
    help: str
    bounds: Bounds = Bounds()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaves(cls: type) -> list[Leaf]:
    """The leaf fields of a (one level nested) config dataclass, in declaration order."""
    out: list[Leaf] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            # A section's defaults are those of its default instance (the app may override them).
            section = _default(f)
            sub_hints = _hints(tp)
            for g in dataclasses.fields(tp):
                default = _default(g)
                if section is not dataclasses.MISSING:
                    default = getattr(section, g.name)
                out.append(Leaf(f.name, g.name, sub_hints[g.name], default, _help(g), _bounds(g)))
        else:
            out.append(Leaf(None, f.name, tp, _default(f), _help(f), _bounds(f)))
    names = [leaf.name for leaf in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"{cls.__name__}: field names must be unique across sections: {dupes}")
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def _bounds(f: dataclasses.Field) -> Bounds:
    return f.metadata.get("bounds", Bounds())


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(get_args(tp)):
            return args[0], True
    return tp, False


def convert(value: str, tp: Any, where: str) -> Any:
    """Turn a string from the command line or environment into a value of type `tp`."""
    base, optional = _strip_optional(tp)
    if optional and value.strip().lower() in {"none", "null"}:
        return None
    try:
        if base is bool:
            v = value.strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no")
        if get_origin(base) is Literal:
            choices = get_args(base)
            if value not in choices:
                raise ValueError(f"expected one of {list(choices)}")
            return value
        if get_origin(base) in (list, tuple):
            (item,) = get_args(base)[:1]
            parts = [p for p in value.replace(",", " ").split() if p]
            items = [convert(p, item, where) for p in parts]
            return items if get_origin(base) is list else tuple(items)
        if base in (int, float, str):
            return base(value)
    except ValueError as e:
        raise ConfigError(f"{where}: cannot read {value!r} as {_type_name(tp)}: {e}") from None
    raise ConfigError(f"{where}: unsupported config type {tp!r}")


def _type_name(tp: Any) -> str:
    base, optional = _strip_optional(tp)
    if get_origin(base) is Literal:
        name = "|".join(map(str, get_args(base)))
    elif get_origin(base) in (list, tuple):
        name = f"list of {getattr(get_args(base)[0], '__name__', 'value')}"
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} or none" if optional else name


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes (an unknown flag, a flag without its value) are `ConfigError`s,
    one line like every other configuration error, instead of a usage block and exit."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")


def build_parser(
    cls: type,
    *,
    description: str = "",
    env_aliases: Mapping[str, Sequence[str]] | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per leaf field (plus `--print-config`)."""
    env_aliases = env_aliases or {}
    parser = _Parser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as JSON and exit",
    )
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for leaf in leaves(cls):
        group = groups.get(leaf.section)
        if group is None:
            group = parser.add_argument_group(leaf.section or "general")
            groups[leaf.section] = group
        help_text = leaf.help or leaf.name
        if leaf.bounds.describe():
            help_text += f"; {leaf.bounds.describe()}"
        if leaf.name in env_aliases:
            help_text += f" [env: {', '.join(env_aliases[leaf.name])}]"
        if leaf.name == "preset" and presets:
            help_text += f" (presets: {', '.join(presets)})"
        default = None if leaf.default is dataclasses.MISSING else leaf.default
        base, _ = _strip_optional(leaf.type)
        kwargs: dict[str, Any] = {"dest": leaf.name, "default": argparse.SUPPRESS}
        if base is bool:
            group.add_argument(
                leaf.flag,
                action=argparse.BooleanOptionalAction,
                help=f"{help_text} (default: {default})",
                **kwargs,
            )
            continue
        metavar = leaf.name.upper()
        choices = leaf.bounds.choices
        if get_origin(base) is Literal:
            choices = get_args(base)
        if choices is not None:
            metavar = "{" + ",".join(map(str, choices() if callable(choices) else choices)) + "}"
        group.add_argument(
            leaf.flag,
            type=str,
            metavar=metavar,
            help=f"{help_text} (default: {default})",
            **kwargs,
        )
    return parser


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    env_aliases: Mapping[str, Sequence[str]] | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    description: str = "",
    prog: str | None = None,
    print_extra: Callable[[T], Mapping[str, Any]] | None = None,
) -> T:
    """Resolve `cls` from flags, then `env` (names in `env_aliases`, first set wins), then the
    preset named by the `preset` field, then defaults. `--print-config` prints JSON and exits;
    `print_extra(cfg)` adds what the app derives from it (a training layout, say)."""
    env = env or {}
    env_aliases = env_aliases or {}
    presets = presets or {}
    parser = build_parser(
        cls, description=description, env_aliases=env_aliases, presets=presets, prog=prog
    )
    args = vars(parser.parse_args(argv))
    print_config = args.pop("print_config", False)
    all_leaves = {leaf.name: leaf for leaf in leaves(cls)}

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}  # where each value came from, for the error messages
    for name, leaf in all_leaves.items():
        if leaf.default is not dataclasses.MISSING:
            values[name] = leaf.default
            origins[name] = f"{leaf.flag} (default)"

    def from_env(name: str) -> tuple[bool, Any]:
        for var in env_aliases.get(name, ()):
            if var in env and env[var] != "":
                origins[name] = f"environment {var}={env[var]}"
                return True, convert(env[var], all_leaves[name].type, f"environment {var}")
        return False, None

    # The preset is itself a config value: resolve it first (flag > env > default).
    if "preset" in all_leaves:
        if "preset" in args:
            values["preset"] = convert(args["preset"], all_leaves["preset"].type, "--preset")
        else:
            found, v = from_env("preset")
            if found:
                values["preset"] = v
        preset = values.get("preset")
        if preset is not None:
            if preset not in presets:
                raise ConfigError(f"--preset {preset!r}: unknown preset; known: {list(presets)}")
            for name, v in presets[preset].items():
                if name not in all_leaves:
                    raise ConfigError(f"preset {preset!r} sets unknown field {name!r}")
                values[name] = v
                origins[name] = f"preset {preset!r} ({all_leaves[name].flag} {v!r})"

    for name in all_leaves:
        found, v = from_env(name)
        if found and name != "preset":
            values[name] = v
    for name, raw in args.items():
        leaf = all_leaves[name]
        if isinstance(raw, bool):
            values[name] = raw
            origins[name] = leaf.flag if raw else "--no-" + leaf.flag[2:]
        else:
            values[name] = convert(raw, leaf.type, leaf.flag)
            origins[name] = f"{leaf.flag} {raw}"

    missing = [all_leaves[n].flag for n in all_leaves if n not in values]
    if missing:
        parser.error(f"missing required values: {', '.join(missing)}")
    cfg = _build(cls, values)
    validate(cfg, origins)
    if print_config:
        extra = dict(print_extra(cfg)) if print_extra else {}
        print(json.dumps({**to_dict(cfg), **extra}, indent=2, default=str))
        raise SystemExit(0)
    return cfg


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = tp(**{g.name: values[g.name] for g in dataclasses.fields(tp)})
        else:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def validate(cfg: Any, origins: Mapping[str, str] | None = None) -> None:
    """Check every leaf against its bounds (floats must be finite), then each section's and the
    config's own `check()` (combinations). `origins` maps a field to where its value came from
    (`--lr nan`, `environment GEO3K_NUM_GPUS=-1`, `preset 'tiny' (...)`) for the message."""
    origins = origins or {}
    for leaf in leaves(type(cfg)):
        section = getattr(cfg, leaf.section) if leaf.section else cfg
        value = getattr(section, leaf.name)
        problem = _problem(leaf, value)
        if problem:
            where = origins.get(leaf.name, f"{leaf.flag} {value!r}")
            raise ConfigError(f"{where}: {problem}")
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section) and hasattr(section, "check"):
            section.check()
    if hasattr(cfg, "check"):
        cfg.check()


def _problem(leaf: Leaf, value: Any) -> str | None:
    if value is None:
        return None
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        if isinstance(item, float) and not math.isfinite(item):
            return "must be a finite number"
        problem = leaf.bounds.problem(item)
        if problem:
            return problem
    return None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain JSON-able data (nested by section)."""
    return dataclasses.asdict(cfg)


def to_json(cfg: Any) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=False, default=str)
