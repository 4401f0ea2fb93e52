"""Context parallelism: one packed THD row split over the CP ranks in the zigzag layout.

Each packed sample is padded at its end to a multiple of ``2 * cp`` (times the TP size under
sequence parallelism, so that every CP rank's part splits evenly over TP) and cut into
``2 * cp`` equal chunks; CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every
sample, in row order. The causal work is then even over the ranks (megatron-core's and
Transformer Engine's THD layout). Padding comes after a sample's tokens, so under causal
attention and the gated delta net's recurrence no real token ever reads it.

:class:`ZigzagLayout` holds one row's index maps (host-built, then on the device) and the
collectives that move tensors between the whole row and a rank's part. The backward of each
is the transpose of its forward, so gradients are exact:

* :meth:`ZigzagLayout.split`: whole row -> this rank's part (an index; backward scatters);
* :meth:`ZigzagLayout.gather`: this rank's part -> the padded whole row on every rank
  (megatron-core's ``gather_from_sequence_parallel_region`` on the CP group: all-gather,
  backward reduce-scatter, so each rank gets the sum of every rank's gradient of its part);
* :func:`reduce_over_cp`: sum of the ranks' contributions (megatron-core's
  ``reduce_from_tensor_model_parallel_region`` on the CP group: all-reduce, backward copy),
  which assembles per-token log-probs that each rank computed for its own rows.

:class:`ContextParallelSeqParams` carries the layout to the layers through megatron-core's
``packed_seq_params`` argument, which the decoder already hands to every attention layer.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import Tensor


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class ZigzagLayout:
    """The zigzag split of one packed row of samples ``lengths`` over ``cp`` ranks.

    Index tensors (LongTensor, on ``device``):

    * ``local_slots[j]``: the padded slot of this rank's token ``j``; ``local_source[j]``: the
      row token in it (``T``, one past the row, for a padding slot);
    * ``gather_order[p]``: where padded slot ``p`` of the whole row sits in the ranks' parts
      concatenated in rank order (what an all-gather returns);
    * ``row_slot[i]``: the padded slot of row token ``i``; ``slot_rank`` / ``slot_local``: the
      rank that holds a padded slot and its index there.
    """

    cp: int
    rank: int
    group: dist.ProcessGroup | None
    lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    local_slots: Tensor
    local_source: Tensor
    gather_order: Tensor
    row_slot: Tensor
    slot_rank: Tensor
    slot_local: Tensor

    @classmethod
    def build(
        cls,
        lengths: list[int] | tuple[int, ...],
        *,
        cp: int,
        rank: int,
        group: dist.ProcessGroup | None,
        multiple: int = 1,
        device: torch.device | str = "cpu",
    ) -> ZigzagLayout:
        """The layout of a row of ``lengths``, each sample padded to a multiple of
        ``2 * cp * multiple`` (``multiple``: the TP size under sequence parallelism)."""
        if cp < 1 or not 0 <= rank < cp:
            raise ValueError(f"context-parallel rank {rank} of {cp}")
        unit = 2 * cp * multiple
        padded = [_ceil_to(n, unit) for n in lengths]
        total = sum(lengths)
        source = torch.full((sum(padded),), total, dtype=torch.long)
        parts: list[list[Tensor]] = [[] for _ in range(cp)]
        start_row, start_slot = 0, 0
        for n, p in zip(lengths, padded, strict=True):
            source[start_slot : start_slot + n] = torch.arange(start_row, start_row + n)
            chunk = p // (2 * cp)
            for r in range(cp):
                for c in (r, 2 * cp - 1 - r):
                    first = start_slot + c * chunk
                    parts[r].append(torch.arange(first, first + chunk))
            start_row, start_slot = start_row + n, start_slot + p
        slots = [torch.cat(p) if p else torch.zeros(0, dtype=torch.long) for p in parts]
        concatenated = torch.cat(slots)
        gather_order = torch.argsort(concatenated)
        per_rank = len(concatenated) // cp
        slot_rank = torch.empty_like(concatenated)
        slot_local = torch.empty_like(concatenated)
        slot_rank[concatenated] = torch.arange(cp).repeat_interleave(per_rank)
        slot_local[concatenated] = torch.arange(per_rank).repeat(cp)
        real = source < total
        row_slot = torch.nonzero(real)[:, 0]
        to = dict(device=device)
        return cls(
            cp=cp,
            rank=rank,
            group=group,
            lengths=tuple(lengths),
            padded_lengths=tuple(padded),
            local_slots=slots[rank].to(**to),
            local_source=source[slots[rank]].to(**to),
            gather_order=gather_order.to(**to),
            row_slot=row_slot.to(**to),
            slot_rank=slot_rank.to(**to),
            slot_local=slot_local.to(**to),
        )

    def to(self, device: torch.device | str) -> ZigzagLayout:
        """The same layout with its index tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **moved)

    # ------------------------------------------------------------------ sizes and boundaries
    @property
    def padded_cu(self) -> list[int]:
        """Sample boundaries in the padded whole row."""
        return [0, *itertools.accumulate(self.padded_lengths)]

    def local_span(self, sample: int) -> tuple[int, Tensor]:
        """``sample``'s first index in this rank's part and the positions inside the sample of
        its slots there (host LongTensor; two chunks)."""
        chunk = self.padded_lengths[sample] // (2 * self.cp)
        offset = sum(self.padded_lengths[:sample]) // self.cp
        first, second = self.rank * chunk, (2 * self.cp - 1 - self.rank) * chunk
        pos = torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])
        return offset, pos

    # ------------------------------------------------------------------ moving tensors
    def split(self, x: Tensor, dim: int = 0) -> Tensor:
        """This rank's part of ``x``, whose ``dim`` runs over the row's tokens; padding slots
        are zeros."""
        pad_shape = list(x.shape)
        pad_shape[dim] = 1
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        return padded.index_select(dim, self.local_source)

    def gather(self, x: Tensor) -> Tensor:
        """The padded whole row ``[P, ...]`` from every rank's part ``x`` ``[P / cp, ...]``
        (dim 0); backward: the sum over ranks of each rank's gradient of this rank's part."""
        whole = gather_from_sequence_parallel_region(x, group=self.group)
        return whole.index_select(0, self.gather_order)

    def local_of_padded(self, x: Tensor) -> Tensor:
        """This rank's part of a padded whole row ``x`` (dim 0)."""
        return x.index_select(0, self.local_slots)

    def owned_rows(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Of row tokens ``rows``: which this rank holds (a mask over ``rows``) and their
        indices in this rank's part."""
        slots = self.row_slot[rows]
        mine = self.slot_rank[slots] == self.rank
        return mine, self.slot_local[slots[mine]]


def reduce_over_cp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The sum over CP ranks of ``x`` (backward: each rank gets the gradient unchanged)."""
    return reduce_from_tensor_model_parallel_region(x, group=group)


@dataclass
class ContextParallelSeqParams(PackedSeqParams):
    """``PackedSeqParams`` of a zigzag-split row: the boundaries are the padded whole row's
    (megatron-core's THD convention under CP) and ``zigzag`` is this rank's split."""

    zigzag: ZigzagLayout | None = None
