"""Both backends follow one learning-rate schedule: the FSDP actor's LambdaLR and the Megatron
actor's megatron-core OptimizerParamScheduler give the same LR at every optimizer step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos.run_context import RunContext
from trainers_fsdp import FsdpConfig, OptimConfig
from trainers_fsdp.optim import lr_lambda
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import _lr_scheduler

LR = 1e-3


def _megatron_lrs(steps: int, **schedule) -> tuple[list[float], list[float]]:
    """LR and the no-decay group's weight decay at each step, as the actor steps them."""
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0, "wd_mult": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    scheduler = _lr_scheduler(optimizer, MegatronConfig(lr=LR, weight_decay=0.1, **schedule))
    lrs, decays = [], []
    for _ in range(steps):
        scheduler.step(1)  # MegatronActor._optimizer_step, before optimizer.step()
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
        MegatronConfig(lr_schedule="cosine")


def test_warmup_fraction_settles_the_same_steps_on_both_backends():
    """The recipes' --lr-warmup-fraction: a fraction of the run's optimizer steps, settled when
    the loop gives the run's length; --lr-warmup-steps wins where set."""
    run = RunContext(model=None, seed=0, use_gpu=False, total_steps=35)
    fsdp = FsdpConfig(optim=OptimConfig(lr=LR, warmup_fraction=0.1)).for_run(run)
    megatron = MegatronConfig(lr=LR, warmup_fraction=0.1).for_run(run)
    assert fsdp.optim.warmup_steps == megatron.warmup_steps == 3
    steps = MegatronConfig(lr=LR, warmup_fraction=0.1, warmup_steps=5).for_run(run)
    assert steps.warmup_steps == 5
