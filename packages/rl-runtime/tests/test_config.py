"""Flags, then environment aliases, then presets, then defaults."""

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from rl_runtime.config import parse_config
from rl_runtime.config_fields import ConfigError, choice, option


@dataclass
class Run:
    preset: str | None = option(None, "preset")
    backend: Literal["megatron", "fsdp"] = option("megatron", "training backend")
    num_gpus: int = option(8, "GPUs")
    resume: bool = option(False, "resume")


@dataclass
class Optim:
    lr: float = option(1e-6, "learning rate")
    betas: tuple[float, ...] = option((0.9, 0.98), "Adam betas")
    load: str | None = option(None, "initial weights")


@dataclass
class App:
    run: Run = field(default_factory=Run)
    optim: Optim = field(default_factory=Optim)


ALIASES = {"backend": ["GEO3K_TRAIN_BACKEND", "MILES_SCRIPT_TRAIN_BACKEND"], "num_gpus": ["N"]}
PRESETS = {"tiny": {"num_gpus": 0, "backend": "fsdp", "lr": 1e-4}}


def parse(argv, env=None):
    return parse_config(App, argv, env=env or {}, env_aliases=ALIASES, presets=PRESETS)


def test_defaults():
    cfg = parse([])
    assert cfg.run.backend == "megatron" and cfg.run.num_gpus == 8
    assert cfg.optim.betas == (0.9, 0.98) and cfg.optim.load is None


def test_precedence_flag_env_preset_default():
    env = {"MILES_SCRIPT_TRAIN_BACKEND": "fsdp", "N": "4"}
    assert parse([], env).run.backend == "fsdp"
    assert parse(["--backend", "megatron"], env).run.backend == "megatron"
    # the GEO3K name wins over the alias when both are set
    env2 = env | {"GEO3K_TRAIN_BACKEND": "megatron"}
    assert parse([], env2).run.backend == "megatron"
    cfg = parse(["--preset", "tiny"], {"N": "2"})
    assert (cfg.run.num_gpus, cfg.run.backend, cfg.optim.lr) == (2, "fsdp", 1e-4)
    assert parse(["--preset", "tiny", "--lr", "3e-5"]).optim.lr == 3e-5


def test_types_and_bools():
    cfg = parse(["--resume", "--betas", "0.5,0.6", "--load", "/x"])
    assert cfg.run.resume is True and cfg.optim.betas == (0.5, 0.6) and cfg.optim.load == "/x"
    assert parse(["--no-resume"]).run.resume is False


def test_bad_values_name_the_flag_or_variable():
    with pytest.raises(ConfigError, match="--num-gpus"):
        parse(["--num-gpus", "eight"])
    with pytest.raises(ConfigError, match="N"):
        parse([], {"N": "x"})
    with pytest.raises(ConfigError, match="GEO3K_TRAIN_BACKEND"):
        parse([], {"GEO3K_TRAIN_BACKEND": "jax"})
    with pytest.raises(ConfigError, match="unknown preset"):
        parse(["--preset", "huge"])


def test_print_config_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--print-config", "--num-gpus", "3"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["num_gpus"] == 3 and out["optim"]["lr"] == 1e-6
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out
    assert "--num-gpus" in text and "learning rate" in text and "GEO3K_TRAIN_BACKEND" in text


@dataclass
class Loop:
    steps: int = option(10, "training steps", ge=1)
    top_p: float = option(1.0, "top-p", gt=0, le=1)
    kind: str = option("a", "kind", choices=("a", "b"))
    batch: int = option(4, "batch", ge=1)
    group: int = option(2, "group", ge=1)
    limit: int | None = option(None, "optional limit", ge=1)

    def check(self) -> None:
        if (self.batch * self.group) % 4:
            raise ConfigError(f"--batch {self.batch} x --group {self.group}: not a multiple of 4")


@dataclass
class Checked:
    run: Run = field(default_factory=Run)
    loop: Loop = field(default_factory=Loop)


CHECKED_PRESETS = {"bad": {"steps": 0}}


def parse_checked(argv, env=None):
    aliases = ALIASES | {"steps": ["STEPS"]}
    return parse_config(Checked, argv, env=env or {}, env_aliases=aliases, presets=CHECKED_PRESETS)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--steps", "-3"], {}, r"^--steps -3: must be >= 1$"),
        (["--steps", "0"], {}, r"^--steps 0: must be >= 1$"),
        (["--top-p", "nan"], {}, r"^--top-p nan: must be a finite number$"),
        (["--top-p", "inf"], {}, r"^--top-p inf: must be a finite number$"),
        (["--top-p", "1.5"], {}, r"^--top-p 1.5: must be > 0 and <= 1$"),
        (["--kind", "c"], {}, r"^--kind c: expected one of \['a', 'b'\]$"),
        (["--limit", "0"], {}, r"^--limit 0: must be >= 1$"),
        ([], {"STEPS": "-2"}, r"^environment STEPS=-2: must be >= 1$"),
        (
            [],
            {"STEPS": "two"},
            r"^environment STEPS=two: training steps; takes a whole number >= 1$",
        ),
        (["--preset", "bad"], {}, r"^preset 'bad' \(--steps 0\): must be >= 1$"),
        (["--batch", "3", "--group", "3"], {}, r"--batch 3 x --group 3"),
        (["--no-such-flag"], {}, r"unrecognized arguments: --no-such-flag"),
    ],
)
def test_bounds_are_checked_where_parsed_naming_the_source(argv, env, message):
    """Every bad value stops parsing (before anything starts, even --print-config), in one line
    that names the flag, the environment variable or the preset."""
    with pytest.raises(ConfigError, match=message):
        parse_checked([*argv, "--print-config"], env)


def test_defaults_pass_and_bounds_show_in_help(capsys):
    cfg = parse_checked([])
    assert (cfg.loop.steps, cfg.loop.limit) == (10, None)
    with pytest.raises(SystemExit):
        parse_checked(["--help"])
    text = capsys.readouterr().out
    assert "--steps STEPS" in text and ">= 1" in text and "--kind {a,b}" in text


# ---------------------------------------------------------------------------------- one tree


@dataclass
class AdamA:
    """A backend's optimizer, nested: its settings have dotted flags and short names."""

    lr: float = field(default=1e-3, metadata={"help": "learning rate", "gt": 0})
    betas: tuple[float, float] = field(
        default=(0.9, 0.98), metadata={"help": "Adam betas", "items": ("beta1", "beta2"), "lt": 1}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip", "flag": "clip_grad"})
    total_steps: int | None = None  # filled in by the app: not a setting


@dataclass
class TrainerA:
    optim: AdamA = field(default_factory=AdamA, metadata={"help": "optimizer"})
    fused: bool = field(default=False, metadata={"help": "fused kernels (A only)"})
    seed: int = 0  # filled in by the app

    def __post_init__(self) -> None:  # needs what only the app knows: not run at parse time
        if self.optim.total_steps is None and self.seed < 0:
            raise ValueError("unreachable at parse")


@dataclass
class TrainerB:
    lr: float = field(default=1e-3, metadata={"help": "learning rate", "gt": 0})
    betas: tuple[float, float] = field(
        default=(0.9, 0.98), metadata={"help": "Adam betas", "items": ("beta1", "beta2")}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip", "flag": "clip_grad"})
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.total_steps is None and self.lr > 1:
            raise ValueError("B needs total_steps")  # as MegatronConfig's cosine check


@dataclass
class TreeRun:
    preset: str | None = option(None, "preset")
    backend: str | None = option(None, "training backend (picks the trainer section)")


@dataclass
class Tree:
    run: TreeRun = field(default_factory=TreeRun)
    trainer: Any = choice({"a": TrainerA, "b": TrainerB}, by="backend")


def parse_tree(argv, env=None, presets=None):
    return parse_config(
        Tree, argv, env=env or {}, env_aliases=ALIASES, presets=presets or {}, defaults=RECIPE
    )


RECIPE = {"backend": "b", "lr": 2e-3}


def test_one_tree_dotted_and_short_flags_pick_the_backends_field():
    b = parse_tree([])
    assert isinstance(b.trainer, TrainerB) and b.trainer.lr == 2e-3  # the recipe over B's default
    a = parse_tree(["--backend", "a", "--lr", "5e-4", "--clip-grad", "0.5", "--beta2", "0.95"])
    assert isinstance(a.trainer, TrainerA)
    assert (a.trainer.optim.lr, a.trainer.optim.max_grad_norm) == (5e-4, 0.5)
    assert a.trainer.optim.betas == (0.9, 0.95)
    dotted = parse_tree(["--backend", "a", "--trainer.optim.lr", "1e-5", "--trainer.fused"])
    assert dotted.trainer.optim.lr == 1e-5 and dotted.trainer.fused is True
    assert parse_tree(["--trainer.lr", "7e-4"]).trainer.lr == 7e-4
    assert parse_tree([], {"GEO3K_TRAIN_BACKEND": "a"}).trainer.optim.lr == 2e-3


def test_parse_time_instances_skip_post_init():
    """B's __post_init__ wants a value the app fills in later; parsing does not run it."""
    assert parse_tree(["--lr", "3"]).trainer.lr == 3


def test_errors_name_the_name_used():
    with pytest.raises(ConfigError, match=r"^--beta2 1: must be < 1$"):
        parse_tree(["--backend", "a", "--beta2", "1"])
    with pytest.raises(ConfigError, match=r"^--trainer.optim.lr 0: must be > 0$"):
        parse_tree(["--backend", "a", "--trainer.optim.lr", "0"])
    with pytest.raises(ConfigError, match=r"^--backend c: expected one of \['a', 'b'\]$"):
        parse_tree(["--backend", "c"])
    with pytest.raises(ConfigError, match=r"^preset 'p' \(--lr 0\): must be > 0$"):
        parse_tree(["--preset", "p"], presets={"p": {"lr": 0}})


def test_a_flag_of_another_backend_is_ignored_with_a_warning(caplog):
    cfg = parse_tree(["--fused", "--lr", "1e-4"])
    assert isinstance(cfg.trainer, TrainerB) and cfg.trainer.lr == 1e-4
    assert "--fused is a setting of --backend a; ignored" in caplog.text
    # a preset's value for another backend is simply not used
    assert parse_tree(["--preset", "p"], presets={"p": {"fused": True}}).trainer.lr == 2e-3


def test_print_config_shows_settings_only_and_help_every_backend(capsys):
    with pytest.raises(SystemExit):
        parse_tree(["--backend", "a", "--print-config"])
    out = json.loads(capsys.readouterr().out)
    assert out["trainer"] == {
        "optim": {"lr": 2e-3, "betas": [0.9, 0.98], "max_grad_norm": 1.0},
        "fused": False,
    }
    with pytest.raises(SystemExit):
        parse_tree(["--help"])
    text = capsys.readouterr().out
    assert "trainer.optim (--backend a)" in text and "trainer (--backend b)" in text
    assert "--trainer.optim.lr LR, --lr LR" in text and "--trainer.lr LR" in text
    assert "--beta2 BETA2" in text and "(default: 0.002)" in text


def test_short_names_must_be_unique():
    @dataclass
    class Clash:
        run: Run = field(default_factory=Run)
        other: Run = field(default_factory=Run)

    with pytest.raises(ConfigError, match="unique"):
        parse_config(Clash, [])
