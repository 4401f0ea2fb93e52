"""Context parallelism in the Megatron actor: each micro-batch's zigzag split over the CP
ranks, planned on the host, and the per-token log-probs assembled from every rank's rows.

A CP rank projects only the rows it holds that predict a scored token; their log-probs go into
a zero row of every token, and the sum over CP ranks (:func:`reduce_over_cp`: all-reduce,
backward copy) is the whole row's log-probs on every rank. The loss is then the same on every
CP rank, and each rank's backward reaches only its own rows: megatron-core's DDP sums the
gradients over data- and context-parallel ranks together (its ``dp_cp`` group), which adds
the ranks' parts into the whole gradient.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from trainer_core import MicroBatch
from vlm_models.megatron.context_parallel import ContextParallelSeqParams, ZigzagLayout


@dataclass
class RowSplit:
    """One micro-batch's split over the CP ranks, as this rank runs it (on the device)."""

    params: ContextParallelSeqParams
    positions: Tensor  # scored row tokens whose predecessor (the row predicting it) is here
    local_rows: Tensor  # those predecessors' indices in this rank's part

    @property
    def layout(self) -> ZigzagLayout:
        assert self.params.zigzag is not None
        return self.params.zigzag


def scored_positions(mb: MicroBatch) -> Tensor:
    """The tokens to score (host): the loss positions, or where there are none every real
    token that has a predecessor in its sample."""
    if mb.loss_positions is not None and mb.loss_positions.numel():
        return mb.loss_positions.long()
    cu = mb.real_cu_seqlens
    return torch.cat(
        [torch.arange(a + 1, b) for a, b in itertools.pairwise(cu)]
        or [torch.zeros(0, dtype=torch.long)]
    )


def split_row(
    mb: MicroBatch,
    *,
    cp: int,
    rank: int,
    group: dist.ProcessGroup | None,
    multiple: int,
    device: torch.device,
) -> RowSplit:
    """The zigzag split of host micro-batch ``mb`` (each sample padded to a multiple of
    ``2 * cp * multiple``), moved to ``device``."""
    layout = ZigzagLayout.build(mb.lengths, cp=cp, rank=rank, group=group, multiple=multiple)
    positions = scored_positions(mb)
    mine, local_rows = layout.owned_rows(positions - 1)
    cu = torch.tensor(layout.padded_cu, dtype=torch.int32, device=device)
    longest = max(layout.padded_lengths)
    params = ContextParallelSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=group,
        zigzag=layout.to(device),
    )
    return RowSplit(params, positions[mine].to(device), local_rows.to(device))
