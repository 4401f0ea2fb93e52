"""Both backends follow one learning-rate schedule: the FSDP actor's LambdaLR and the Megatron
actor's megatron-core OptimizerParamScheduler give the same LR at every optimizer step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos.optimizer import OptimConfig
from rl_algos.run_context import RunContext
from trainers_fsdp import FsdpConfig
from trainers_fsdp.optim import lr_lambda
from trainers_megatron import MegatronConfig
from trainers_megatron.optim import build_scheduler

LR = 1e-3


def _megatron_lrs(steps: int, **schedule) -> tuple[list[float], list[float]]:
    """LR and the no-decay group's weight decay at each step, as the actor steps them."""
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0, "wd_mult": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    optim = OptimConfig(lr=LR, weight_decay=0.1, **schedule)
    scheduler = build_scheduler(optimizer, optim)
    lrs, decays = [], []
    for _ in range(steps):
        scheduler.step(1)  # as MegatronActor.apply_update does, before the optimizer steps
        lrs.append(optimizer.param_groups[0]["lr"])
        decays.append((optimizer.param_groups[0]["weight_decay"], groups[1]["weight_decay"]))
    return lrs, decays


def _fsdp_lrs(steps: int, **schedule) -> list[float]:
    factor = lr_lambda(OptimConfig(lr=LR, **schedule))
    return [LR * factor(s) for s in range(steps)]


@pytest.mark.parametrize(
    "schedule",
    [
        dict(lr_schedule="constant"),
        dict(lr_schedule="constant", warmup_steps=3),
        dict(lr_schedule="cosine", total_steps=6),
        dict(lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr=0.1 * LR),
    ],
    ids=["constant", "warmup", "cosine", "warmup-cosine-floor"],
)
def test_backends_share_the_schedule(schedule):
    steps = 8  # past total_steps: the cosine stays at its floor
    megatron, decays = _megatron_lrs(steps, **schedule)
    assert megatron == pytest.approx(_fsdp_lrs(steps, **schedule), rel=1e-12, abs=1e-15)
    assert all(d == (0.1, 0.0) for d in decays)  # decay on matrices only, constant
    if schedule.get("warmup_steps"):
        assert megatron[0] == pytest.approx(LR / schedule["warmup_steps"])  # never a 0-LR step
    if schedule["lr_schedule"] == "cosine":
        floor = schedule.get("min_lr", 0.0)
        assert megatron[schedule["total_steps"] - 1] == pytest.approx(floor, abs=1e-15)
        assert megatron[-1] == pytest.approx(floor, abs=1e-15)


def test_megatron_config_refuses_a_cosine_without_length():
    with pytest.raises(ValueError, match="total_steps"):
        MegatronConfig(optim=OptimConfig(lr_schedule="cosine"))


def test_warmup_fraction_settles_the_same_steps_on_both_backends():
    """The recipes' --lr-warmup-fraction: a fraction of the run's optimizer steps, settled when
    the loop gives the run's length; --lr-warmup-steps wins where set."""
    run = RunContext(model=None, seed=0, use_gpu=False, total_steps=35)
    optim = OptimConfig(lr=LR, warmup_fraction=0.1)
    fsdp = FsdpConfig(optim=optim).for_run(run)
    megatron = MegatronConfig(optim=optim).for_run(run)
    assert fsdp.optim.warmup_steps == megatron.optim.warmup_steps == 3
    steps = MegatronConfig(optim=OptimConfig(lr=LR, warmup_fraction=0.1, warmup_steps=5))
    assert steps.for_run(run).optim.warmup_steps == 5


# ------------------------------------------------------------------------------------------
# One name per setting, and each phase's own schedule (issue 50)


def test_both_backends_name_each_shared_setting_alike():
    """A flag a user learned on one backend sets the same setting on the other: every setting
    of one trainer section whose short name the other has too sits at the same dotted path
    (`--trainer.optim.lr` on both, never `--trainer.lr` on one of them)."""
    from geo3k_grpo.main import parse
    from rl_runtime.config_fields import leaves

    def trainer_settings(backend: str) -> dict[str | None, str]:
        cfg = parse(["--backend", backend], env={})
        return {leaf.short: leaf.dotted for leaf in leaves(cfg) if leaf.path[0] == "trainer"}

    fsdp, megatron = trainer_settings("fsdp"), trainer_settings("megatron")
    shared = fsdp.keys() & megatron.keys()
    optimizer = {"lr", "lr_schedule", "lr_warmup_steps", "lr_warmup_fraction", "min_lr"}
    assert optimizer | {"betas", "weight_decay", "clip_grad"} <= shared
    assert {name: fsdp[name] for name in shared} == {name: megatron[name] for name in shared}


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_dotted_optimizer_flags_set_the_same_setting_on_both_backends(backend):
    from geo3k_grpo.main import parse
    from rl_runtime import ConfigError

    cfg = parse(["--preset", "tiny", "--backend", backend, "--trainer.optim.lr", "0.001"], env={})
    assert cfg.trainer.optim.lr == 1e-3
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --trainer\.lr "):
        parse(["--preset", "tiny", "--backend", backend, "--trainer.lr", "0.001"], env={})


GRPO_SCHEDULE = ["--lr-schedule", "cosine", "--lr-warmup-steps", "2", "--min-lr", "1e-5"]


def _warmup_trainer(backend: str, monkeypatch) -> tuple[object, object]:
    """The trainer config geo3k_grpo's warm-up hands the SFT run (the run itself not started),
    and the parsed config, under a GRPO schedule of cosine with a warm-up and a floor."""
    import geo3k_grpo.main as app
    import rl_runtime.sft
    from rl_runtime.grpo_app import warm_up

    cfg = app.parse(["--preset", "tiny", "--backend", backend, *GRPO_SCHEDULE], env={})
    got = {}
    # warm_up imports it from rl_runtime.sft when it runs (the launcher parses before torch)
    fake = lambda w, *, trainer, **kw: got.setdefault("t", trainer)  # noqa: E731
    monkeypatch.setattr(rl_runtime.sft, "sft_warmup", fake)
    warm_up(cfg, app.RECIPE)
    return got["t"], cfg


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_the_sft_warmup_keeps_a_constant_rate_whatever_the_grpo_schedule(backend, monkeypatch):
    """--lr-schedule, --lr-warmup-steps and --min-lr are the GRPO steps': the warm-up trains at
    --warmup-sft-lr from its first step to its last, on both backends."""
    warm, cfg = _warmup_trainer(backend, monkeypatch)
    optim, w = warm.optim, cfg.warmup
    assert (optim.lr, optim.lr_schedule, optim.warmup_steps, optim.min_lr) == (
        w.warmup_sft_lr,
        "constant",
        0,
        0.0,
    )
    assert optim.total_steps == w.warmup_sft_steps
    run = RunContext(model=None, seed=0, use_gpu=False, total_steps=cfg.loop.optimizer_steps)
    grpo = cfg.trainer.for_run(run).optim  # the GRPO steps keep the schedule asked for
    assert (grpo.lr, grpo.lr_schedule, grpo.warmup_steps, grpo.min_lr) == (5e-4, "cosine", 2, 1e-5)


def test_the_sft_warmup_steps_at_its_constant_rate(monkeypatch):
    """The FSDP actor built from the warm-up's config takes its first steps at --warmup-sft-lr
    (a linear warm-up over 2 steps would take the first at half of it)."""
    from trainers_fsdp.actor import FsdpActor
    from trainers_fsdp.synthetic import synthetic_batch

    warm, cfg = _warmup_trainer("fsdp", monkeypatch)
    actor = FsdpActor(warm)
    batch = synthetic_batch(warm.model, [20, 16], grpo=False)
    lrs = [actor.train_step(batch, loss="sft")["lr"] for _ in range(2)]
    assert lrs == [cfg.warmup.warmup_sft_lr] * 2


def test_a_floor_above_the_peak_is_refused_at_parse():
    """--min-lr above --lr (megatron-core's scheduler asserts it; FSDP's cosine would rise) is
    one line naming both flags, on either backend, before anything starts."""
    from geo3k_sft.main import parse
    from rl_runtime import ConfigError

    for backend in ("fsdp", "megatron"):
        with pytest.raises(ConfigError, match=r"--min-lr 1e-06 must not exceed --lr 5e-07"):
            parse(["--backend", backend, "--lr", "5e-7"], env={})
