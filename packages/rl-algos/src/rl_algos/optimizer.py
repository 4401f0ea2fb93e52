"""The optimizer's settings, one dataclass for every trainer backend: AdamW, gradient-norm
clipping and the learning-rate schedule (linear warm-up, then constant or cosine). Defined once
here (plain data, no torch) so that each setting has one name on every backend: the FSDP and
Megatron configs both hold it as their ``optim`` section (``--trainer.optim.lr``, ``--lr``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

LrSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[LrSchedule, ...] = ("constant", "cosine")


@dataclass(frozen=True)
class Schedule:
    """A phase's own learning-rate schedule, in place of the optimizer settings' (which are
    the run's training steps'): a GRPO run's SFT warm-up trains at a constant rate of its own,
    whatever schedule the GRPO steps follow."""

    lr: float
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0


@dataclass
class OptimConfig:
    """AdamW with gradient-norm clipping and a warm-up + (constant | cosine) schedule, for the
    run's training steps (a GRPO run's SFT warm-up has a schedule of its own: `Schedule`)."""

    lr: float = field(
        default=1e-6,
        metadata={
            "help": "learning rate of the run's training steps (GRPO's or SFT's; the peak, "
            "after any --lr-warmup-steps); a GRPO run's SFT warm-up has its own "
            "(--warmup-sft-lr)",
            "gt": 0,
        },
    )
    # the recipes' betas and decay (miles / slime geo3k); torch's AdamW defaults are 0.999, 0.01
    betas: tuple[float, float] = field(
        default=(0.9, 0.98),
        metadata={"help": "Adam betas", "items": ("adam_beta1", "adam_beta2"), "ge": 0, "lt": 1},
    )
    eps: float = 1e-8
    weight_decay: float = field(  # applied to matrices only; norms, biases: none
        default=0.1, metadata={"help": "weight decay", "ge": 0}
    )
    max_grad_norm: float = field(  # <= 0: report the norm, do not clip
        default=1.0,
        metadata={
            "help": "gradient-norm clip (0: report the norm, do not clip)",
            "flag": "clip_grad",
            "ge": 0,
        },
    )
    lr_schedule: LrSchedule = field(
        default="constant",
        metadata={
            "help": "learning-rate schedule of the run's training steps (not the SFT "
            "warm-up's: that one is constant)"
        },
    )
    warmup_steps: int = field(  # linear warm-up from 0 to lr
        default=0,
        metadata={
            "help": "linear learning-rate warm-up over the first N optimizer steps of the "
            "run's training (not the SFT warm-up: --warmup-sft-steps)",
            "flag": "lr_warmup_steps",
            "ge": 0,
        },
    )
    total_steps: int | None = None  # cosine: optimizer steps to decay over (warm-up included)
    min_lr: float = field(  # the recipes' --min-lr (miles' SFT script: 1e-6)
        default=0.0, metadata={"help": "cosine schedule's floor (a learning rate)", "ge": 0}
    )
    warmup_fraction: float = field(  # the recipes' --lr-warmup-fraction; steps win when set
        default=0.0,
        metadata={
            "help": "linear learning-rate warm-up over this fraction of the run's optimizer "
            "steps (when --lr-warmup-steps is 0)",
            "flag": "lr_warmup_fraction",
            "ge": 0,
            "le": 1,
        },
    )

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"optim.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")

    def check(self) -> None:
        """A launcher's check of the combination (`rl_runtime.config.validate`)."""
        if self.min_lr > self.lr:
            raise ValueError(
                f"--min-lr {self.min_lr:g} must not exceed --lr {self.lr:g} (the cosine "
                "schedule's floor is below its peak)"
            )

    def for_run(self, total_steps: int | None, schedule: Schedule | None = None) -> OptimConfig:
        """These settings for a run of ``total_steps`` optimizer steps: the warm-up's steps
        settled from ``warmup_fraction``, or ``schedule`` (a phase's own) in place of the
        learning rate, schedule, warm-up and floor."""
        if schedule is not None:
            return replace(
                self,
                lr=schedule.lr,
                lr_schedule=schedule.lr_schedule,
                warmup_steps=schedule.warmup_steps,
                warmup_fraction=0.0,
                min_lr=schedule.min_lr,
                total_steps=total_steps,
            )
        return replace(self, total_steps=total_steps, warmup_steps=self.settled_warmup(total_steps))

    def settled_warmup(self, total_steps: int | None) -> int:
        """The warm-up's optimizer steps: ``warmup_steps`` if set, else ``warmup_fraction`` of
        the run (megatron-core's ``lr_warmup_fraction`` rounds the same way)."""
        if self.warmup_steps or not self.warmup_fraction or not total_steps:
            return self.warmup_steps
        return int(self.warmup_fraction * total_steps)
