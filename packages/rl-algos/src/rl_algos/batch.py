"""The batch type the trainers consume, and helpers to pack its per-sample lists.

Every per-token tensor of a sample is aligned with that sample's ``input_ids`` (see the token
alignment convention in ``docs/architecture.md``), so packing samples end to end is plain
concatenation and ``cu_seqlens`` recovers them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# The per-token fields a training loss reads (packed into each micro-batch), and all the
# fields aligned token by token with input_ids (checked on construction).
LOSS_FIELDS = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
_TOKEN_FIELDS = (*LOSS_FIELDS, "mm_token_type_ids")


@dataclass
class TrainBatch:
    """Per-sample lists of one training batch; sample ``i`` has ``L_i = len(input_ids[i])`` tokens.

    Optional per-token fields are ``None`` (absent for the whole batch) or a list with one tensor
    of length ``L_i`` per sample. ``pixel_values`` / ``image_grid_thw`` hold one entry per sample,
    ``None`` for a text-only sample.
    """

    input_ids: list[Tensor]  # LongTensor[L_i]: prompt + response, exactly as the rollout produced
    loss_mask: list[Tensor]  # FloatTensor[L_i]: 1.0 on response tokens the loss counts
    advantages: list[Tensor] | None = None  # FloatTensor[L_i], zero outside the mask
    old_logprobs: list[Tensor] | None = None  # FloatTensor[L_i]: trainer, before the update
    ref_logprobs: list[Tensor] | None = None  # FloatTensor[L_i]: reference model
    rollout_logprobs: list[Tensor] | None = None  # FloatTensor[L_i]: as the engine reported
    pixel_values: list[Tensor | None] | None = None  # FloatTensor[P_i, D] per sample
    image_grid_thw: list[Tensor | None] | None = None  # LongTensor[n_img_i, 3] per sample
    mm_token_type_ids: list[Tensor] | None = None  # LongTensor[L_i], 1 at image tokens
    # IntTensor[L_i, num_hidden_layers, top_k] (any integer dtype): the experts the engine's
    # router chose for token t at each decoder layer, replayed by the trainers (MoE models,
    # routing replay); the last row is never routed by the engine and may hold any valid ids
    routed_experts: list[Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = self.lengths
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if value is None or name == "input_ids":
                continue
            if len(value) != n:
                raise ValueError(f"TrainBatch.{name} has {len(value)} entries, input_ids has {n}")
            if name in _TOKEN_FIELDS:
                for i, (t, length) in enumerate(zip(value, lengths, strict=True)):
                    if t.shape != (length,):
                        raise ValueError(
                            f"TrainBatch.{name}[{i}] has shape {tuple(t.shape)}, "
                            f"expected ({length},) to align with input_ids[{i}]"
                        )
            if name == "routed_experts":
                _check_routed_experts(value, lengths)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        """Token count of each sample."""
        return [int(t.shape[0]) for t in self.input_ids]

    @property
    def num_tokens(self) -> int:
        """Total tokens over all samples (prompt + response)."""
        return sum(self.lengths)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """A new batch with the samples at ``indices``, in that order (tensors are shared)."""
        idx = [int(i) for i in indices]
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = None if value is None else [value[i] for i in idx]
        return TrainBatch(**picked)


def _check_routed_experts(values: list[Tensor], lengths: list[int]) -> None:
    """Each sample's ids are ``[L_i, layers, k]`` integers, the same ``(layers, k)`` for all."""
    trailing = None
    for i, (t, length) in enumerate(zip(values, lengths, strict=True)):
        if t.dim() != 3 or t.shape[0] != length:
            raise ValueError(
                f"TrainBatch.routed_experts[{i}] has shape {tuple(t.shape)}, expected "
                f"({length}, num_hidden_layers, top_k) to align with input_ids[{i}]"
            )
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"TrainBatch.routed_experts[{i}] holds {t.dtype}, not expert ids")
        if trailing is None:
            trailing = tuple(t.shape[1:])
        elif tuple(t.shape[1:]) != trailing:
            raise ValueError(
                f"TrainBatch.routed_experts[{i}] has (layers, top_k) {tuple(t.shape[1:])}, "
                f"sample 0 has {trailing}"
            )


def pack_sequences(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Concatenate per-sample tensors end to end; returns ``(packed, cu_seqlens)``.

    ``cu_seqlens`` is an int32 tensor ``[0, L_0, L_0 + L_1, ...]`` (the flash-attention layout).
    """
    if len(tensors) == 0:
        raise ValueError("pack_sequences needs at least one tensor")
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(tensors) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return torch.cat(list(tensors), dim=0), cu_seqlens.to(tensors[0].device)


def unpack_sequences(packed: Tensor, cu_seqlens: Tensor | Sequence[int]) -> list[Tensor]:
    """Split a packed tensor back into per-sample views (the inverse of :func:`pack_sequences`)."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else [int(b) for b in cu_seqlens]
    if bounds[0] != 0 or bounds[-1] != packed.shape[0]:
        raise ValueError(
            f"cu_seqlens must run from 0 to {packed.shape[0]} (the packed length); got "
            f"{bounds[0]}..{bounds[-1]}"
        )
    return [packed[a:b] for a, b in itertools.pairwise(bounds)]


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens each, as few as
    first-fit decreasing needs and as even in size as a greedy spread makes them.

    First-fit decreasing fixes the count; the samples are then dealt again, longest first, each
    to the least-filled micro-batch with room. Even sizes matter beyond balance: first-fit
    leaves one small remainder micro-batch, and a compiled layer guards on a lower size bound
    (inductor's indexing and fusion choices, seen at 5,120 tokens on the H200), so a remainder
    below it recompiles the layer at some later step. A sample longer than the budget gets a
    micro-batch of its own (logged once). Indices inside each micro-batch are in ascending
    order; micro-batches are ordered by their first index. Deterministic.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    too_long = [i for i in order if int(lengths[i]) > max_tokens]
    fitting = [i for i in order if int(lengths[i]) <= max_tokens]
    first_fit = _deal(fitting, lengths, max_tokens, count=0, least_filled=False)
    even = _deal(fitting, lengths, max_tokens, count=len(first_fit), least_filled=True)
    bins = even if len(even) <= len(first_fit) else first_fit
    if too_long:
        logger.warning(
            "%d sample(s) are longer than max_tokens=%d; each gets its own micro-batch",
            len(too_long),
            max_tokens,
        )
    packed = [sorted(b) for b in bins] + [[i] for i in too_long]
    packed.sort(key=lambda b: b[0])
    return packed


def _deal(
    order: list[int], lengths: Sequence[int], max_tokens: int, *, count: int, least_filled: bool
) -> list[list[int]]:
    """Place ``order`` into ``count`` bins (more where none has room): into the first bin with
    room, or with ``least_filled`` the emptiest one that has room."""
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in order:
        length = int(lengths[i])
        fits = [b for b in range(len(bins)) if load[b] + length <= max_tokens]
        if fits:
            b = min(fits, key=lambda b: (load[b], b)) if least_filled else fits[0]
        else:
            bins.append([])
            load.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        load[b] += length
    return [b for b in bins if b]
