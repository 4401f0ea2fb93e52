"""rl_algos: the GRPO core (advantages, losses, log-prob helpers, the TrainBatch type). Torch only."""

from rl_algos.advantages import (
    GroupFilterResult,
    broadcast_advantages,
    compute_grpo_advantages,
    filter_zero_variance_groups,
    group_index,
    whiten_advantages,
)
from rl_algos.batch import TrainBatch, pack_by_token_budget, pack_sequences, unpack_sequences
from rl_algos.logprobs import (
    aligned_entropy,
    aligned_logprobs,
    entropy_from_logits,
    logprobs_from_logits,
)
from rl_algos.losses import (
    GrpoLossConfig,
    LossAggMode,
    aggregate_loss,
    grpo_loss,
    kl_penalty,
    loss_denominator,
    masked_mean,
    policy_loss,
    sft_loss,
)

__all__ = [
    "GroupFilterResult",
    "GrpoLossConfig",
    "LossAggMode",
    "TrainBatch",
    "aggregate_loss",
    "aligned_entropy",
    "aligned_logprobs",
    "broadcast_advantages",
    "compute_grpo_advantages",
    "entropy_from_logits",
    "filter_zero_variance_groups",
    "group_index",
    "grpo_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominator",
    "masked_mean",
    "pack_by_token_budget",
    "pack_sequences",
    "policy_loss",
    "sft_loss",
    "unpack_sequences",
    "whiten_advantages",
]
