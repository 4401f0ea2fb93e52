"""GRPO / PPO policy losses, KL penalties, loss aggregation and SFT cross-entropy.

All functions take flat packed ``[T]`` tensors aligned to ``input_ids`` (the token alignment
convention), with ``cu_seqlens`` marking the samples, so one call covers a whole micro-batch.
Metrics are detached scalar tensors computed over the masked tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from rl_algos.batch import LOSS_FIELDS
from rl_algos.config import GrpoLossConfig, KlType, LossAggMode
from rl_algos.metrics import Reduce

logger = logging.getLogger(__name__)

# exp() of a log-ratio beyond this overflows float32 or means the policies share no support.
_MAX_LOG_RATIO = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def _bounds_list(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    """Python ints, with one device-to-host copy for a GPU tensor (not one per element)."""
    return cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else [int(b) for b in cu_seqlens]


def _seq_index(cu_seqlens: Tensor | Sequence[int], total: int, device) -> tuple[Tensor, int]:
    bounds = torch.as_tensor(_bounds_list(cu_seqlens), dtype=torch.long)
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total}, got {bounds[0]}..{bounds[-1]}")
    lengths = bounds[1:] - bounds[:-1]
    index = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return index.to(device), len(lengths)


def _seq_sum(values: Tensor, index: Tensor, num_seqs: int) -> Tensor:
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, index, values
    )


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` where ``mask != 0``, else 0; unlike ``values * mask``, an inf or NaN at an
    unmasked position (log-probs there are unspecified) cannot leak into the sum."""
    return torch.where(mask != 0, values, torch.zeros_like(values))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask != 0`` (0 when the mask is empty)."""
    return _masked(values, mask).sum() / (mask != 0).sum().clamp(min=1).to(values.dtype)


def loss_denominator(loss_mask: Sequence[Tensor], mode: LossAggMode) -> float:
    """What ``aggregate_loss`` divides by over a whole step, for its ``denominator``.

    Masked tokens (``token-mean``), samples with a masked token (``seq-mean-token-mean``) or
    samples (``seq-mean-token-sum-norm``) of ``loss_mask`` (per-sample masks). A trainer sums
    this over its micro-batches and ranks so the step's loss equals one big batch's.
    """
    if mode == "token-mean":
        return float(sum(int((m > 0).sum()) for m in loss_mask))
    if mode == "seq-mean-token-mean":
        return float(sum(1 for m in loss_mask if bool((m > 0).any())))
    if mode == "seq-mean-token-sum-norm":
        return float(len(loss_mask))
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def aggregate_loss(
    values: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    mode: LossAggMode = "token-mean",
    *,
    norm_length: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Reduce per-token ``values [T]`` to a scalar over the masked tokens.

    - ``token-mean``: every masked token of the micro-batch weighs the same.
    - ``seq-mean-token-mean``: mean over tokens inside each sample, then over samples (samples
      with no masked token are left out); GSPO's choice.
    - ``seq-mean-token-sum-norm``: each sample's token sum divided by a constant
      ``norm_length``, then averaged over samples (Dr. GRPO: no length bias). Pass the maximum
      response length as ``norm_length``; by default the longest masked span in the batch.

    ``denominator`` replaces this micro-batch's own count (masked tokens for ``token-mean``,
    samples for the seq modes) with the count of the whole optimizer step, across micro-batches
    and data-parallel ranks; summing the micro-batch losses then gives the exact step mean.
    """
    mask = loss_mask.to(values.dtype)
    if mode == "token-mean":
        if denominator is not None:
            return _masked(values, mask).sum() / denominator
        return masked_mean(values, mask)
    index, num_seqs = _seq_index(cu_seqlens, values.shape[0], values.device)
    seq_sums = _seq_sum(_masked(values, mask), index, num_seqs)
    seq_counts = _seq_sum(mask, index, num_seqs)
    if mode == "seq-mean-token-mean":
        has_tokens = seq_counts > 0
        seq_means = seq_sums / seq_counts.clamp(min=1)
        count = has_tokens.sum().clamp(min=1) if denominator is None else denominator
        return (seq_means * has_tokens).sum() / count
    if mode == "seq-mean-token-sum-norm":
        norm = (
            float(norm_length) if norm_length is not None else float(seq_counts.max().clamp(min=1))
        )
        count = num_seqs if denominator is None else denominator
        return seq_sums.sum() / (count * norm)
    raise ValueError(
        f"unknown loss_agg_mode {mode!r}; use token-mean, seq-mean-token-mean or "
        "seq-mean-token-sum-norm"
    )


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KlType = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's estimators).

    - ``k1`` / ``kl``: ``log pi - log pi_ref`` (unbiased, high variance, can be negative).
    - ``k2`` / ``mse``: ``0.5 * (log pi - log pi_ref)^2``.
    - ``k3`` / ``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0), with the
      log-ratio clamped to +-20 and the result to [-10, 10] so one bad token cannot blow up.
    """
    diff = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return diff
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.exp(log_ratio) - log_ratio - 1
        return k3.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown kl kind {kind!r}; use k1/kl, k2/mse or k3/low_var_kl")


def _gspo_log_ratio(
    logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, cu_seqlens, total: int
) -> Tensor:
    """GSPO-token log-ratio: value = the sample's mean token log-ratio, gradient per token."""
    index, num_seqs = _seq_index(cu_seqlens, total, logprobs.device)
    log_ratio = _masked(logprobs - old_logprobs, mask)
    seq_mean = _seq_sum(log_ratio, index, num_seqs) / _seq_sum(mask, index, num_seqs).clamp(min=1)
    return seq_mean.detach()[index] + logprobs - logprobs.detach()


def policy_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    config: GrpoLossConfig,
    rollout_logprobs: Tensor | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (clip-higher, optional dual clip, GSPO, TIS); ``(loss, metrics)``."""
    mask = loss_mask.to(logprobs.dtype)
    total = logprobs.shape[0]
    if config.gspo:
        log_ratio = _gspo_log_ratio(logprobs, old_logprobs, mask, cu_seqlens, total)
    else:
        log_ratio = logprobs - old_logprobs
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.eps_clip, 1.0 + config.eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    metrics: dict[str, Tensor] = {}
    if config.dual_clip_c is not None:
        bound = -adv * config.dual_clip_c
        dual_active = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        metrics["dual_clip_frac"] = masked_mean(dual_active.to(mask.dtype), mask).detach()

    if rollout_logprobs is not None:
        gap = (old_logprobs - rollout_logprobs).detach()
        metrics["rollout_logprob_abs_diff"] = masked_mean(gap.abs(), mask)
        metrics["rollout_logprob_abs_diff_max"] = _masked_max(gap.abs(), mask)
    if config.use_tis:
        if rollout_logprobs is None:
            raise ValueError("use_tis=True needs rollout_logprobs")
        log_w = (old_logprobs - rollout_logprobs).detach().clamp(max=_MAX_LOG_RATIO)
        weight = torch.exp(log_w).clamp(max=config.tis_cap)
        per_token = per_token * weight
        metrics["tis_weight_mean"] = masked_mean(weight, mask)
        metrics["tis_clip_frac"] = masked_mean(
            (torch.exp(log_w) > config.tis_cap).to(mask.dtype), mask
        )

    loss = aggregate_loss(
        per_token,
        mask,
        cu_seqlens,
        config.loss_agg_mode,
        norm_length=config.norm_length,
        denominator=denominator,
    )
    with torch.no_grad():
        token_log_ratio = logprobs - old_logprobs
        metrics["pg_loss"] = loss.detach()
        metrics["clip_frac"] = masked_mean(clip_active.to(mask.dtype), mask)
        metrics["clip_frac_low"] = masked_mean(
            (clip_active & (ratio < 1.0 - config.eps_clip)).to(mask.dtype), mask
        )
        metrics["clip_frac_high"] = masked_mean(
            (clip_active & (ratio > 1.0 + config.eps_clip_high)).to(mask.dtype), mask
        )
        metrics["approx_kl"] = masked_mean(kl_penalty(logprobs, old_logprobs, "k3"), mask)
        metrics["ppo_kl"] = masked_mean(-token_log_ratio, mask)
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        metrics["ratio_min"] = -_masked_max(-ratio, mask)
        metrics["ratio_max"] = _masked_max(ratio, mask)
    return loss, metrics


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` where ``mask`` is set, 0 where it is nowhere set. No boolean indexing:
    its size would be a host read of the device."""
    zero = values.new_zeros(())
    if values.numel() == 0:
        return zero
    on = mask != 0
    picked = torch.where(on, values.detach(), values.new_full((), -torch.inf)).amax()
    return torch.where(on.any(), picked, zero)


def grpo_loss(
    logprobs: Tensor,
    *,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    config: GrpoLossConfig,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss + ``kl_coef`` * KL to the reference - ``entropy_coef`` * entropy.

    All inputs are flat packed ``[T]`` tensors aligned to ``input_ids``; ``logprobs`` (and
    ``entropy``) carry the gradient. ``denominator``: see :func:`aggregate_loss` (the step-wide
    token or sample count, for gradient accumulation). Returns the scalar loss and detached metrics (``loss``,
    ``pg_loss``, ``clip_frac``, ``approx_kl``, ``ratio_min`` / ``ratio_max``, ``kl_loss`` and
    ``entropy`` when computed, ``rollout_logprob_abs_diff`` when rollout log-probs are given).
    """
    total = logprobs.shape[0]
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
        ("ref_logprobs", ref_logprobs),
        ("rollout_logprobs", rollout_logprobs),
        ("entropy", entropy),
    ):
        if t is not None and t.shape != (total,):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected ({total},) like logprobs"
            )
    loss, metrics = policy_loss(
        logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        config=config,
        rollout_logprobs=rollout_logprobs,
        denominator=denominator,
    )
    agg = {
        "mode": config.loss_agg_mode,
        "norm_length": config.norm_length,
        "denominator": denominator,
    }
    if config.kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_type)
        kl_loss = aggregate_loss(kl, loss_mask, cu_seqlens, **agg)
        loss = loss + config.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    elif ref_logprobs is not None:
        with torch.no_grad():
            metrics["kl_loss"] = aggregate_loss(
                kl_penalty(logprobs, ref_logprobs, config.kl_type), loss_mask, cu_seqlens, **agg
            )
    if entropy is not None:
        ent = aggregate_loss(entropy, loss_mask, cu_seqlens, **agg)
        if config.entropy_coef != 0.0:
            loss = loss - config.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    elif config.entropy_coef != 0.0:
        raise ValueError("entropy_coef != 0 needs entropy")
    metrics["loss"] = loss.detach()
    return loss, metrics


def sft_loss(
    logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    mode: LossAggMode = "token-mean",
    *,
    norm_length: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Cross-entropy (negative log-likelihood) over the masked tokens of packed samples.

    ``logprobs`` come from :func:`rl_algos.aligned_logprobs`, so position ``t`` scores token ``t``.
    """
    return aggregate_loss(
        -logprobs, loss_mask, cu_seqlens, mode, norm_length=norm_length, denominator=denominator
    )


# ------------------------------------------------------------------------------- loss objects
EntropyMode = Literal["grad", "metric"] | None

# Every metric grpo_loss may return, with its reduction over micro-batches and ranks
# (rl_algos.metrics). "loss" is left out: the trainer step reports the step's loss itself.
GRPO_METRICS: dict[str, Reduce] = {
    "pg_loss": "mean",
    "clip_frac": "mean",
    "clip_frac_low": "mean",
    "clip_frac_high": "mean",
    "dual_clip_frac": "mean",
    "approx_kl": "mean",
    "ppo_kl": "mean",
    "ratio_mean": "mean",
    "ratio_min": "min",
    "ratio_max": "max",
    "rollout_logprob_abs_diff": "mean",
    "rollout_logprob_abs_diff_max": "max",
    "tis_weight_mean": "mean",
    "tis_clip_frac": "mean",
    "kl_loss": "mean",
    "entropy": "mean",
}


@dataclass(frozen=True)
class GrpoLoss:
    """:func:`grpo_loss` as an object a trainer step takes: what it reads, how it aggregates,
    which metrics it returns and whether it needs the entropy.

    Called on one micro-batch's flat tensors, it returns that micro-batch's own loss (its
    aggregation over its own tokens or samples) and metrics; the trainer step scales it by the
    micro-batch's share of the step's tokens or samples (``rl_algos.train_step``).
    """

    config: GrpoLossConfig = field(default_factory=GrpoLossConfig)
    name: str = "grpo"
    fields: tuple[str, ...] = LOSS_FIELDS
    metrics: dict[str, Reduce] = field(default_factory=lambda: dict(GRPO_METRICS))

    @property
    def agg_mode(self) -> LossAggMode:
        return self.config.loss_agg_mode

    @property
    def norm_length(self) -> float | None:
        return self.config.norm_length

    def with_norm_length(self, norm_length: float) -> GrpoLoss:
        return replace(self, config=replace(self.config, norm_length=norm_length))

    def entropy_mode(self, log_entropy: bool) -> EntropyMode:
        """``"grad"`` for an entropy bonus, ``"metric"`` to only report it, else None."""
        if self.config.entropy_coef:
            return "grad"
        return "metric" if log_entropy else None

    def check(self, batch) -> None:
        """The batch has what this loss reads (``batch``: a :class:`rl_algos.TrainBatch`)."""
        if len(batch) and batch.advantages is None:
            raise ValueError("train_step(loss='grpo') needs batch.advantages")
        if self.config.kl_coef and batch.ref_logprobs is None:
            raise ValueError(
                "grpo kl_coef > 0 needs batch.ref_logprobs (compute_logprobs(batch, reference=True))"
            )

    def __call__(
        self,
        logprobs: Tensor,
        fields: dict[str, Tensor],
        cu_seqlens: Sequence[int],
        entropy: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = grpo_loss(
            logprobs,
            old_logprobs=fields.get("old_logprobs", logprobs.detach()),
            advantages=fields["advantages"],
            loss_mask=fields["loss_mask"],
            cu_seqlens=cu_seqlens,
            config=self.config,
            ref_logprobs=fields.get("ref_logprobs"),
            rollout_logprobs=fields.get("rollout_logprobs"),
            entropy=entropy,
        )
        metrics.pop("loss")
        return loss, metrics


@dataclass(frozen=True)
class SftLoss:
    """:func:`sft_loss` as a loss object (see :class:`GrpoLoss`); reports the entropy of the
    masked tokens when the trainer computes it."""

    agg_mode: LossAggMode = "token-mean"
    norm_length: float | None = None
    name: str = "sft"
    fields: tuple[str, ...] = ("loss_mask",)
    metrics: dict[str, Reduce] = field(default_factory=lambda: {"entropy": "mean"})

    def with_norm_length(self, norm_length: float) -> SftLoss:
        return replace(self, norm_length=norm_length)

    def entropy_mode(self, log_entropy: bool) -> EntropyMode:
        return "metric" if log_entropy else None

    def check(self, batch) -> None:
        pass

    def __call__(
        self,
        logprobs: Tensor,
        fields: dict[str, Tensor],
        cu_seqlens: Sequence[int],
        entropy: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        mask = fields["loss_mask"]
        value = sft_loss(logprobs, mask, cu_seqlens, self.agg_mode, norm_length=self.norm_length)
        metrics = {}
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        return value, metrics


TrainLoss = GrpoLoss | SftLoss
LOSSES = ("grpo", "sft")


def resolve_loss(
    loss: str | TrainLoss, *, grpo: GrpoLossConfig, sft_agg_mode: LossAggMode = "token-mean"
) -> TrainLoss:
    """A loss object from a name at the trainer protocol's boundary (``"grpo"`` with the
    trainer's GRPO settings, ``"sft"``); a loss object is returned as it is."""
    if not isinstance(loss, str):
        return loss
    if loss == "grpo":
        return GrpoLoss(grpo)
    if loss == "sft":
        return SftLoss(sft_agg_mode)
    raise ValueError(f"loss must be one of {LOSSES} or a loss object, got {loss!r}")
