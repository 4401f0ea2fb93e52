"""Flags, then environment aliases, then presets, then defaults."""

import json
from dataclasses import dataclass, field
from typing import Literal

import pytest

from rl_runtime.config import ConfigError, option, parse_config


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
        ([], {"STEPS": "two"}, r"^environment STEPS: cannot read 'two' as int"),
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
