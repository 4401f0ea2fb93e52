"""Typed configuration: a tree of dataclasses -> command-line flags, then environment, then
presets, then the app's recipe, then the packages' own defaults.

Each package owns the dataclass of its settings, next to its code; an app composes them into one
tree (its config's fields are the sections) and declares nothing a second time. A field is a
*setting* when its metadata has a help text; packages that do not depend on rl-runtime write
`field(default=..., metadata={"help": ...})`, and `option()` is the short form. A nested
dataclass field is a section when it has a help text too (the root's are all sections); fields
without one are what the app fills in when it builds the part (a model path, a seed). Metadata:

- `help`; `ge`, `gt`, `le`, `lt` (numeric bounds); `choices` (a sequence, or a function that
  returns one, for registries imported only when checked). A float is always finite.
- `flag`: the setting's short name where it is not the field's (`max_grad_norm` -> `clip_grad`).
- `items`: short names of a tuple's elements (`betas` -> `adam_beta1`, `adam_beta2`).

Every setting gets a dotted flag, its path (`--trainer.optim.lr`, `--loop.num-rollout`), and a
short one (`--lr`, `--num-rollout`); short names must be unique in a tree. `choice()` makes a
section whose dataclass another setting picks (`--backend` picks the trainer's); the flags of
every choice are known, and one of a choice not picked is ignored with a warning.

Precedence, highest first: command-line flag, environment variable (the app passes the mapping
and the aliases; this module never reads `os.environ`), preset, the app's recipe (`defaults`),
the package's default. Flags, presets, the recipe and aliases may use either name.

Every value is checked where it is parsed, before anything starts: its bounds, then each
section's (and the root's) `check()` for combinations (a `ValueError` there is a bad
combination, its message naming the flags). A bad value is a `ConfigError` whose one
line names the flag, variable or preset it came from. A section's own `__post_init__` runs when
the app completes it (a trainer config's derived fields are not known at parse time), so the
parser sets settings on a copy of the section's default instance.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import logging
import math
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from rl_runtime.config_fields import (
    Bounds,
    ConfigError,
    Leaf,
    all_picks,
    choice_fields,
    convert,
    field_hints,
    flag_name,
    is_section,
    is_setting,
    item_type,
    leaves,
    section_help,
    setting_key,
    skeleton,
    strip_optional,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Tree:
    """The settings of one set of picks, by every name they answer to, with their values and
    where each value came from."""

    def __init__(self, cfg: Any, select: Mapping[str, Sequence[str]]) -> None:
        self.cfg = cfg
        self.leaves = leaves(cfg)
        for by, names in select.items():  # a selecting setting's choices: the option names
            self._update(self.leaf(by), bounds=Bounds(choices=list(names)))
        self.values = {leaf.path: leaf.default for leaf in self.leaves}
        self.origins = {leaf.path: f"{leaf.display} (default)" for leaf in self.leaves}

    @property
    def index(self) -> dict[str, tuple[Leaf, int | None]]:
        return {key: (leaf, i) for leaf in self.leaves for key, i in leaf.names()}

    def leaf(self, key: str) -> Leaf | None:
        hit = self.index.get(setting_key(key))
        return hit[0] if hit else None

    def _update(self, leaf: Leaf | None, **changes: Any) -> None:
        assert leaf is not None
        self.leaves[self.leaves.index(leaf)] = dataclasses.replace(leaf, **changes)

    def apply_recipe(self, defaults: Mapping[str, Any]) -> None:
        """The app's own defaults: they stand for the packages' (`--help` shows them)."""
        for key, value in defaults.items():
            if self.set(key, value, ""):
                leaf = self.leaf(key)
                self._update(leaf, default=self.values[leaf.path])
                self.origins[leaf.path] = f"{leaf.display} (default)"

    def set(self, key: str, value: Any, origin: str, *, where: str | None = None) -> bool:
        """Set the setting `key` names (a string from a flag or variable is converted, errors
        naming `where`); False when no setting of this tree has that name."""
        hit = self.index.get(setting_key(key))
        if hit is None:
            return False
        leaf, item = hit
        if where is not None and isinstance(value, str):
            tp = leaf.type if item is None else item_type(leaf.type)
            value = convert(value, tp, origin, leaf.help, leaf.bounds)
        if item is not None:
            current = list(self.values[leaf.path])
            current[item] = value
            value = tuple(current)
        self.values[leaf.path] = value
        self.origins[leaf.path] = origin
        return True

    def resolve(self, key: str, sources: Iterator[tuple[str, Any, str, str | None]]) -> Any:
        """The value of `key` after those of `sources` that name the same setting."""
        target = self.leaf(key)
        assert target is not None
        for name, value, origin, where in sources:
            leaf = self.leaf(name)
            if leaf is not None and leaf.path == target.path:
                self.set(name, value, origin, where=where)
        return self.values[target.path]

    def origin(self, key: str) -> str:
        leaf = self.leaf(key)
        assert leaf is not None
        return self.origins[leaf.path]

    def build(self) -> Any:
        """The config: a copy of each section's default instance with its settings set."""

        def rebuild(obj: Any, path: tuple[str, ...]) -> Any:
            obj = copy.copy(obj)
            for f in dataclasses.fields(obj):
                here = (*path, f.name)
                if here in self.values:
                    object.__setattr__(obj, f.name, self.values[here])
                elif dataclasses.is_dataclass(getattr(obj, f.name)):
                    object.__setattr__(obj, f.name, rebuild(getattr(obj, f.name), here))
            return obj

        return rebuild(self.cfg, ())


# ---------------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes (an unknown flag, a flag without its value) are `ConfigError`s,
    one line like every other configuration error, instead of a usage block and exit. A flag is
    taken only as written: argparse's abbreviations would read a misspelt `--num-roll 3` as
    `--num-rollout 3`; an unknown flag is refused with the closest flags named."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self._suggest(unknown)}")
        return parsed

    def _suggest(self, unknown: Sequence[str]) -> str:
        """`; --num-roll: did you mean --num-rollout?` for each unknown flag with close ones
        (difflib), among the short flags, or the dotted ones for a dotted name."""
        flags = [f for action in self._actions for f in action.option_strings if f.startswith("--")]
        hints = []
        for arg in unknown:
            if not arg.startswith("--"):
                continue  # a value of the unknown flag before it
            name = arg.partition("=")[0]
            same_kind = [f for f in flags if ("." in f) == ("." in name)]
            close = difflib.get_close_matches(name, same_kind, n=3, cutoff=0.75)
            if close:
                hints.append(f"{name}: did you mean {' or '.join(close)}?")
        return f"; {'; '.join(hints)}" if hints else ""


class _Given(argparse.Action):
    """Records each flag as given, in order: the name used decides which setting it sets (a
    short name is another field under another backend) and is the one errors name."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.given.append((option_string, values))


class _GivenBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.given.append((option_string, not option_string.startswith("--no-")))


def _help(
    leaf: Leaf,
    default: Any,
    env_aliases: Mapping[str, Sequence[str]],
    item: int | None,
    extra: str = "",
) -> str:
    text = leaf.help or leaf.name
    if item is not None:
        text += f" (item {item + 1} of {len(leaf.items)})"
    if leaf.bounds.describe():
        text += f"; {leaf.bounds.describe()}"
    env = [v for key, _ in leaf.names() for v in env_aliases.get(key, ())]
    if env:
        text += f" [env: {', '.join(env)}]"
    if default in (None, (), []) and "default:" in (leaf.help or ""):
        return f"{text}{extra}"  # the help says what unset means: "(default: half of --num-gpus)"
    return f"{text}{extra} (default: {default})"


def build_parser(
    cls: type,
    trees: Sequence[_Tree],
    *,
    description: str = "",
    env_aliases: Mapping[str, Sequence[str]] | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with the flags of every tree (every choice), plus `--print-config`."""
    env_aliases = env_aliases or {}
    usage = (
        "%(prog)s [--preset NAME] [--print-config] [--SETTING VALUE | --SECTION.SETTING VALUE]..."
    )
    parser = _Parser(prog=prog, usage=usage, description=description)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as JSON and exit",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    taken: set[str] = set()

    # A setting every pick has (the backends' shared optimizer section) is listed once, in a
    # section named without the pick; a section's declared help heads its group.
    shared = set.intersection(*({leaf.path for leaf in t.leaves} for t in trees))

    def group_for(tree: _Tree, leaf: Leaf) -> argparse._ArgumentGroup:
        title = ".".join(leaf.path[:-1]) or "general"
        if leaf.picked_by and leaf.path not in shared:
            title += f" (--{leaf.picked_by[0].replace('_', '-')} {leaf.picked_by[1]})"
        if title not in groups:
            about = section_help(tree.cfg, leaf.path[:-1]) or None
            groups[title] = parser.add_argument_group(title, about)
        return groups[title]

    def add(tree: _Tree, flags: list[str], leaf: Leaf, item: int | None) -> None:
        free = [f for f in flags if f not in taken]
        if not free:
            return
        taken.update(free)
        group = group_for(tree, leaf)
        tp = leaf.type if item is None else item_type(leaf.type)
        default = leaf.default if item is None else leaf.default[item]
        extra = (
            f" (also {', '.join(f for f in flags if f not in free)})"
            if len(free) < len(flags)
            else ""
        )
        if leaf.name == "preset" and presets:
            extra += f" (presets: {', '.join(presets)})"
        help_text = _help(leaf, default, env_aliases, item, extra)
        flags = free
        base, _ = strip_optional(tp)
        if base is bool:
            group.add_argument(*flags, action=_GivenBool, dest="_", default=None, help=help_text)
            return
        choices = leaf.bounds.listed() if item is None else None
        name = leaf.name if item is None else leaf.items[item]
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else name.upper()
        group.add_argument(*flags, action=_Given, dest="_", metavar=metavar, help=help_text)

    for tree in trees:
        for leaf in tree.leaves:
            add(tree, [leaf.flag, *([flag_name(leaf.short)] if leaf.short else [])], leaf, None)
            for i, item in enumerate(leaf.items):
                add(tree, [flag_name(item)], leaf, i)
    return parser


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    env_aliases: Mapping[str, Sequence[str]] | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    description: str = "",
    prog: str | None = None,
    print_extra: Callable[[T], Mapping[str, Any]] | None = None,
) -> T:
    """Resolve `cls` from flags, then `env` (names in `env_aliases`, first set wins), then the
    preset named by the `preset` setting, then the app's recipe `defaults`, then the packages'
    defaults. `--print-config` prints JSON and exits; `print_extra(cfg)` adds what the app
    derives from it (a training layout, say)."""
    env, env_aliases, presets = env or {}, env_aliases or {}, presets or {}
    select = {
        f.metadata["select"]: list(f.metadata["options"]) for f in choice_fields(cls).values()
    }
    trees = {_pick_key(p): _Tree(skeleton(cls, p), select) for p in all_picks(cls)}
    for tree in trees.values():
        tree.apply_recipe(defaults or {})
    parser = build_parser(
        cls,
        list(trees.values()),
        description=description,
        env_aliases=env_aliases,
        presets=presets,
        prog=prog,
    )
    args = parser.parse_args(argv, namespace=argparse.Namespace(given=[]))

    def sources(preset: str | None) -> Iterator[tuple[str, Any, str, str | None]]:
        """(key, value, origin, where) from the preset, the environment, then the flags
        (`where` names a string's source for conversion errors; None: a typed preset value)."""
        if preset is not None:
            for key, v in presets[preset].items():
                yield key, v, f"preset {preset!r} ({flag_name(key)} {v!r})", None
        for key, names in env_aliases.items():
            var = next((n for n in names if env.get(n, "") != ""), None)
            if var is not None:
                yield key, env[var], f"environment {var}={env[var]}", f"environment {var}"
        for opt, v in args.given:
            key = setting_key(opt.removeprefix("--no-") if isinstance(v, bool) else opt)
            yield key, v, opt if isinstance(v, bool) else f"{opt} {v}", opt

    # The preset, then each setting that picks a section, are values too: they go first.
    first = next(iter(trees.values()))
    preset = first.resolve("preset", sources(None)) if "preset" in first.index else None
    if preset is not None and preset not in presets:
        raise ConfigError(f"{first.origin('preset')}: unknown preset; known: {list(presets)}")
    picks = {}
    for path, f in choice_fields(cls).items():
        by, names = f.metadata["select"], list(f.metadata["options"])
        picks[path] = first.resolve(by, sources(preset))
        if picks[path] not in names:
            raise ConfigError(f"{first.origin(by)}: expected one of {names}")
    tree = trees[_pick_key(picks)]
    for key, v, origin, where in sources(preset):
        if tree.set(key, v, origin, where=where):
            continue
        other = next((t.leaf(key) for t in trees.values() if t.leaf(key)), None)
        if other is None or other.picked_by is None:
            source = origin if where is None else where
            raise ConfigError(f"{source}: no setting is called {key!r}")
        if where is not None:  # a flag or variable of another pick; a preset's is just unused
            by, name = other.picked_by
            log.warning("%s is a setting of %s %s; ignored", where, flag_name(by), name)

    cfg = tree.build()
    validate(cfg, tree.origins)
    if args.print_config:
        extra = dict(print_extra(cfg)) if print_extra else {}
        print(json.dumps({**to_dict(cfg), **extra}, indent=2, default=str))
        raise SystemExit(0)
    return cfg


def _pick_key(picks: Mapping[tuple[str, ...], str]) -> tuple[tuple[tuple[str, ...], str], ...]:
    return tuple(sorted(picks.items()))


def validate(cfg: Any, origins: Mapping[tuple[str, ...], str] | None = None) -> None:
    """Check every setting against its bounds (floats must be finite), then each section's and
    the config's own `check()` (combinations). `origins` maps a setting's path to where its
    value came from (`--lr nan`, `environment GEO3K_NUM_GPUS=-1`, `preset 'tiny' (...)`)."""
    origins = origins or {}
    for leaf in leaves(cfg):
        value = _get(cfg, leaf.path)
        problem = _problem(leaf, value)
        if problem:
            where = origins.get(leaf.path, f"{leaf.display} {value!r}")
            raise ConfigError(f"{where}: {problem}")
    for part in _sections(cfg):
        if hasattr(part, "check"):
            try:
                part.check()
            except ConfigError:
                raise
            except ValueError as err:  # a package's check() names its flags in a ValueError
                raise ConfigError(str(err)) from None


def _get(cfg: Any, path: Sequence[str]) -> Any:
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


def _sections(cfg: Any, root: bool = True) -> Iterator[Any]:
    """The sections of the tree, deepest first, then the root."""
    hints = field_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "options" in f.metadata or is_section(f, hints[f.name], root):
            yield from _sections(value, root=False)
    yield cfg


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


def to_dict(cfg: Any, *, root: bool = True) -> dict[str, Any]:
    """The settings as plain JSON-able data, nested by section (what the app fills in is not
    a setting and is left out)."""
    out: dict[str, Any] = {}
    hints = field_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "options" in f.metadata or is_section(f, hints[f.name], root):
            out[f.name] = to_dict(value, root=False)
        elif is_setting(f, root):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def to_json(cfg: Any) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=False, default=str)
