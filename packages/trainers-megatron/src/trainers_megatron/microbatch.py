"""The Megatron micro-batch plan: which samples a rank runs, packed to a token budget.

The ranks of one model replica (its tensor-, pipeline- and context-parallel ranks) run the same
samples, the replica's first rank's (:func:`group_batch`); data-parallel replicas each take
their own. :func:`plan_micro_batches` packs them, as trainers_fsdp's plan does, with the same
count on every data-parallel rank where experts are split over them. The micro-batches
themselves are :class:`trainer_core.MicroBatch`, built by the actor's ``micro_batches``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rl_algos import TrainBatch, pack_by_token_budget


def group_batch(batch: TrainBatch, cp_group: Any) -> TrainBatch:
    """The model replica's batch (its tensor-, pipeline- and context-parallel ranks): the
    replica's first rank's, on every rank of it (over TP x PP, then over CP)."""
    for group in (parallel_state.get_model_parallel_group(), cp_group):
        if dist.get_world_size(group) == 1:
            continue
        holder = [batch]
        src = dist.get_process_group_ranks(group)[0]
        dist.broadcast_object_list(holder, src=src, group=group)
        batch = holder[0]
    return batch


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    one_per_micro_batch: bool,
    ep: int,
    dp_group: Any,
    device: torch.device,
) -> list[list[int]]:
    """Packs of at most ``max_tokens`` tokens a row (``max_tokens_per_gpu``, ``cp`` times that
    under context parallelism, each CP rank holding its share). With expert parallelism
    (``ep`` > 1) every data-parallel rank runs as many micro-batches as the busiest (empty ones
    run a dummy sample): the experts' token exchange is collective in every MoE layer.
    ``one_per_micro_batch``: every sample alone (models whose packed row would mix samples)."""
    if one_per_micro_batch:
        plan = [[i] for i in range(len(lengths))]
    else:
        plan = pack_by_token_budget(lengths, max_tokens) if lengths else []
    if ep > 1:
        count = torch.tensor([len(plan)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        plan += [[] for _ in range(int(count.item()) - len(plan))]
    return plan
