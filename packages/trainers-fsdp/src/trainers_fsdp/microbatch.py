"""The FSDP micro-batch plan: samples packed to a token budget, the same count on every rank.

Under FSDP every rank must run the same number of forwards (each all-gathers parameters), so
:func:`plan_micro_batches` agrees on a count across ranks. The micro-batches themselves are
:class:`trainer_core.MicroBatch` (built by :func:`trainer_core.build_micro_batch`, with a dummy
image sample where a row has none, so that the vision tower runs on every rank).
"""

from __future__ import annotations

import torch

from rl_algos import pack_by_token_budget
from trainers_fsdp.distributed import all_reduce_


def plan_micro_batches(
    lengths: list[int], max_tokens: int, *, one_per_micro_batch: bool = False
) -> list[list[int]]:
    """Pack sample indices to ``max_tokens`` per micro-batch, with the same count on all ranks.

    A rank that needs fewer micro-batches than the busiest rank first splits its largest
    multi-sample micro-batches (smaller forwards, no wasted work), then adds empty ones (run as a
    dummy sample only). ``one_per_micro_batch``: every sample alone (models whose packed forward
    would mix samples).
    """
    if one_per_micro_batch:
        bins = [[i] for i in range(len(lengths))]
    else:
        bins = pack_by_token_budget(lengths, max_tokens) if lengths else []
    target = int(all_reduce_(torch.tensor([len(bins)]), torch.distributed.ReduceOp.MAX).item())
    while len(bins) < target:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        big = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(big)
        half, acc, total = [], 0, sum(lengths[i] for i in big)
        for i in big:
            if acc < total / 2 and len(half) < len(big) - 1:
                half.append(i)
                acc += lengths[i]
        rest = [i for i in big if i not in half]
        bins.extend([half, rest])
    return bins
