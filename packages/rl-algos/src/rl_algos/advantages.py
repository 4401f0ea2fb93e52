"""GRPO advantages and reward post-processing, with exact zeros for constant groups.

The reference recipes report a real failure: with non-binary rewards (0 / 0.9) in float32, a
group whose rewards are all equal can get ``reward - mean != 0`` (0.9 is not representable, and
the rounding of the sum differs from that of the value), a spurious gradient. Their workaround
casts rewards to float16. Here the statistics are computed in float64, and a group whose rewards
are all equal gets an advantage of exactly 0.0 by construction, in every output dtype and for any
reward value. ``reward_dtype`` is kept so the recipes' setting still means the same thing: the
rewards are first rounded to it, and the result is returned in it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_REWARD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _as_tensor(rewards: Tensor | Sequence[float]) -> Tensor:
    # Python floats are float64: keep them so (torch.as_tensor alone would round them to float32
    # before the caller's own rounding to reward_dtype).
    t = rewards if isinstance(rewards, Tensor) else torch.as_tensor(rewards, dtype=torch.float64)
    if t.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(t.shape)}")
    return t


def group_index(
    n: int,
    *,
    group_size: int | None = None,
    group_ids: Tensor | Sequence[int] | None = None,
    device: torch.device | None = None,
) -> tuple[Tensor, int]:
    """Dense group index in ``[0, G)`` for each of ``n`` samples, and ``G``.

    Exactly one of ``group_size`` (samples ``[k*g, (k+1)*g)`` form group ``k``) or ``group_ids``
    (any integer label per sample; groups may be uneven and interleaved) must be given.
    """
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size or group_ids")
    if group_size is not None:
        if group_size <= 0 or n % group_size != 0:
            raise ValueError(f"{n} rewards do not split into groups of group_size={group_size}")
        return torch.arange(n, device=device) // group_size, n // group_size
    ids = torch.as_tensor(group_ids, device=device)
    if ids.shape != (n,):
        raise ValueError(f"group_ids has shape {tuple(ids.shape)}, expected ({n},)")
    _, inverse = torch.unique(ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if n else 0
    return inverse, num_groups


class GroupStats(NamedTuple):
    """Per-sample view of its group's statistics (float64)."""

    mean: Tensor  # [N] group mean
    std: Tensor  # [N] group std (unbiased; 0 for a group of one)
    constant: Tensor  # [N] bool: every reward in the group is equal


def group_stats(rewards: Tensor, index: Tensor, num_groups: int) -> GroupStats:
    """Mean, unbiased std and "all equal" flag of each sample's group, computed in float64."""
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count.index_add_(0, index, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, index, r)
    mean = (total / count)[index]
    centred = r - mean
    sq = torch.zeros_like(count).index_add_(0, index, centred * centred)
    dof = (count - 1).clamp(min=1)
    std = torch.sqrt(sq / dof)[index]
    gmax = torch.full_like(count, -torch.inf).scatter_reduce_(0, index, r, "amax")
    gmin = torch.full_like(count, torch.inf).scatter_reduce_(0, index, r, "amin")
    constant = (gmax == gmin)[index]
    return GroupStats(mean=mean, std=std, constant=constant)


def compute_grpo_advantages(
    rewards: Tensor | Sequence[float],
    *,
    group_size: int | None = None,
    group_ids: Tensor | Sequence[int] | None = None,
    std_normalization: bool = True,
    eps: float = 1e-6,
    reward_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-sample GRPO advantages ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g``).

    Args:
        rewards: ``[N]`` scalar reward per sample.
        group_size: consecutive groups of this size (the usual ``n_samples_per_prompt``).
        group_ids: or an integer group label per sample; uneven groups (after filtering or
            failed samples) are each normalised over their own members.
        std_normalization: divide by the group's (unbiased) std + ``eps``, the reference
            recipes' default; ``False`` gives Dr. GRPO (mean-centring only).
        eps: added to the std.
        reward_dtype: the rewards are rounded to this dtype first (the recipes' float16
            workaround stays expressible) and the result is returned in it. Statistics are
            always computed in float64.

    Returns:
        ``[N]`` advantages in ``reward_dtype``. A group whose rewards are all equal (including a
        group of one) gets exactly 0.0.
    """
    if reward_dtype not in _REWARD_DTYPES:
        raise ValueError(f"reward_dtype must be one of {_REWARD_DTYPES}, got {reward_dtype}")
    r = _as_tensor(rewards).to(reward_dtype)
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function's output first")
    index, num_groups = group_index(
        r.shape[0], group_size=group_size, group_ids=group_ids, device=r.device
    )
    stats = group_stats(r, index, num_groups)
    adv = r.to(torch.float64) - stats.mean
    if std_normalization:
        adv = adv / (stats.std + eps)
    adv = torch.where(stats.constant, torch.zeros_like(adv), adv)
    return adv.to(reward_dtype)


def broadcast_advantages(
    advantages: Tensor, loss_mask: Sequence[Tensor], *, dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    """Per-token advantages: sample ``i``'s advantage on its masked tokens, 0 elsewhere."""
    if advantages.shape != (len(loss_mask),):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected ({len(loss_mask)},)"
        )
    out = []
    for a, m in zip(advantages, loss_mask, strict=True):
        mask = m.to(dtype)
        out.append(torch.where(mask != 0, a.to(dtype).to(mask.device), torch.zeros_like(mask)))
    return out


def whiten_advantages(
    advantages: Sequence[Tensor],
    loss_mask: Sequence[Tensor],
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> list[Tensor]:
    """Batch-level whitening of per-token advantages over all masked tokens (float64 stats).

    ``shift_mean=False`` only rescales (keeps each token's sign). Tokens outside the mask stay 0.
    """
    a = torch.cat([t.to(torch.float64) for t in advantages])
    m = torch.cat([t.to(torch.float64) for t in loss_mask]) != 0
    vals = a[m]
    if vals.numel() < 2:
        return [t.clone() for t in advantages]
    mean = vals.mean()
    std = vals.std()
    out = (a - mean) / (std + eps) if shift_mean else a / (std + eps)
    out = torch.where(m, out, torch.zeros_like(out))
    pieces = torch.split(out, [t.shape[0] for t in advantages])
    return [p.to(t.dtype) for p, t in zip(pieces, advantages, strict=True)]


class GroupFilterResult(NamedTuple):
    """Outcome of :func:`filter_zero_variance_groups`."""

    keep_indices: Tensor  # LongTensor[K]: samples of the kept groups, ascending
    num_groups: int
    num_dropped_groups: int


def filter_zero_variance_groups(
    rewards: Tensor | Sequence[float],
    *,
    group_size: int | None = None,
    group_ids: Tensor | Sequence[int] | None = None,
) -> GroupFilterResult:
    """DAPO dynamic sampling: drop the groups whose rewards are all equal (no learning signal).

    Returns the indices of the samples to keep and how many groups were dropped, so the caller
    can log it and, if it wants, sample more prompts to refill the batch.
    """
    r = _as_tensor(rewards)
    index, num_groups = group_index(
        r.shape[0], group_size=group_size, group_ids=group_ids, device=r.device
    )
    stats = group_stats(r, index, num_groups)
    keep = torch.nonzero(~stats.constant).flatten()
    dropped_groups = int(torch.unique(index[stats.constant]).numel())
    if dropped_groups:
        logger.debug("dynamic sampling dropped %d of %d groups", dropped_groups, num_groups)
    return GroupFilterResult(keep, num_groups, dropped_groups)
