"""rl_algos: the GRPO core (advantages, losses and loss objects, log-prob helpers, the TrainBatch
type, and the backend-neutral trainer step of :mod:`rl_algos.train_step`). Torch only.

The settings (`GrpoLossConfig`) import here; every other name is imported from its module on
first use (PEP 562 `__getattr__`), so a launcher parses its flags without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from rl_algos.config import GrpoLossConfig, LossAggMode

#: Each public name not imported above, by the module that defines it.
_LAZY: dict[str, tuple[str, ...]] = {
    "rl_algos.advantages": (
        "GroupFilterResult",
        "broadcast_advantages",
        "compute_grpo_advantages",
        "filter_zero_variance_groups",
        "group_index",
        "whiten_advantages",
    ),
    "rl_algos.batch": (
        "LOSS_FIELDS",
        "TrainBatch",
        "pack_by_token_budget",
        "pack_sequences",
        "unpack_sequences",
    ),
    "rl_algos.logprobs": (
        "aligned_entropy",
        "aligned_logprobs",
        "entropy_from_logits",
        "logprobs_from_logits",
        "scatter_rows",
    ),
    "rl_algos.losses": (
        "GRPO_METRICS",
        "LOSSES",
        "EntropyMode",
        "GrpoLoss",
        "SftLoss",
        "TrainLoss",
        "aggregate_loss",
        "grpo_loss",
        "kl_penalty",
        "loss_denominator",
        "masked_mean",
        "policy_loss",
        "resolve_loss",
        "sft_loss",
    ),
    "rl_algos.metrics": ("Reduce", "StepMetrics"),
    "rl_algos.train_step": (
        "STEP_METRICS",
        "MicroBatches",
        "MicroBatchLoss",
        "TrainBackend",
        "collect_logprobs",
        "loss_units",
        "run_sequentially",
    ),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
_SUBMODULES = ("train_step",)  # the step's functions: rl_algos.train_step.train_step(...)

__all__ = ["GrpoLossConfig", "LossAggMode", *_SUBMODULES]
__all__ += sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
