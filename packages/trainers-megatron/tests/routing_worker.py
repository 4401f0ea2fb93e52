"""One rank of the routing-replay layouts (launched by test_routing_replay.py).

Usage: ``RANK=r WORLD_SIZE=2 MASTER_PORT=p python routing_worker.py case.pt out_dir``. For each
layout: the log-probs of this rank's samples routed to their ids, then one GRPO step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vlm_models.megatron import _cpu_compat

if not torch.cuda.is_available():
    _cpu_compat.apply()

from rl_algos.optimizer import OptimConfig
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor


def main(case_path: str, out_dir: str) -> None:
    case = torch.load(case_path, weights_only=False)
    rank = int(os.environ["RANK"])
    out: dict[str, dict] = {}
    for name, layout in case["layouts"].items():
        optim = OptimConfig(lr=1e-3, weight_decay=0.0)
        config = MegatronConfig(
            model=case["preset"], optim=optim, seed=0, routing_replay=True, **layout
        )
        actor = MegatronActor(config)
        # expert parallel ranks are data-parallel: each takes its own samples
        indices = ([0, 1], [2])[rank] if layout.get("ep", 1) > 1 else [0, 1, 2]
        batch = case["batch"].select(indices)
        logprobs = actor.compute_logprobs(batch)
        batch.old_logprobs = logprobs
        metrics = actor.train_step(batch, loss="grpo")
        out[name] = dict(indices=indices, logprobs=logprobs, **metrics)
        del actor
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
