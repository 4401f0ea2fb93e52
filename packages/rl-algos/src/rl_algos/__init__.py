"""rl_algos: the GRPO core (advantages, losses and loss objects, log-prob helpers, the TrainBatch
type, and the backend-neutral trainer step of :mod:`rl_algos.train_step`). Torch only.

The settings (`GrpoLossConfig`) import here; every other name is imported from its module on
first use (`lazy_loader.attach`, PEP 562), so a launcher parses its flags without torch.
"""

from __future__ import annotations

import lazy_loader

from rl_algos.config import GrpoLossConfig, LossAggMode

# every public name not imported above is imported from its module on first use
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["train_step"],
    submod_attrs={
        "advantages": [
            "GroupFilterResult",
            "broadcast_advantages",
            "compute_grpo_advantages",
            "filter_zero_variance_groups",
            "group_index",
            "whiten_advantages",
        ],
        "batch": [
            "LOSS_FIELDS",
            "TrainBatch",
            "pack_by_token_budget",
            "pack_sequences",
            "unpack_sequences",
        ],
        "logprobs": [
            "aligned_entropy",
            "aligned_logprobs",
            "entropy_from_logits",
            "logprobs_from_logits",
            "scatter_rows",
        ],
        "losses": [
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
        ],
        "metrics": ["Reduce", "StepMetrics"],
        "train_step": [
            "STEP_METRICS",
            "MicroBatches",
            "MicroBatchLoss",
            "TrainBackend",
            "collect_logprobs",
            "loss_units",
            "run_sequentially",
        ],
    },
)
__all__ += ["GrpoLossConfig", "LossAggMode"]
