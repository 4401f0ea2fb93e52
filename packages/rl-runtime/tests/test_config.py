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
