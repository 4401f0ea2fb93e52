"""One gloo rank of test_train_step.py's metrics test: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=...
MASTER_PORT=... python metrics_worker.py out.json``."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from rl_algos import StepMetrics

SPECS = {"m": "mean", "s": "sum", "lo": "min", "hi": "max", "never": "max"}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        metrics = StepMetrics(SPECS, "cpu")
        # rank 0: two micro-batches, rank 1: one
        for value, weight in [[(1.0, 1.0), (3.0, 3.0)], [(5.0, 4.0)]][rank]:
            metrics.update(
                {"m": torch.tensor(value), "lo": torch.tensor(value), "hi": value}, weight
            )
            metrics.add("s", torch.tensor(value))
        result = metrics.read(extra={"x": torch.tensor(float(rank))})
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
