"""One rank of the multi-process tests: run as a script with torchrun-style env variables.

Builds the tiny actor, takes this rank's shard of a fixed batch, accumulates the gradient of
the global-batch loss and writes the full gradients and metrics (rank 0) to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import mixed_batch, tiny_actor_config
from trainers_fsdp import FsdpActor, FsdpConfig, OptimConfig


def shard(n: int, rank: int, world: int) -> list[int]:
    """Uneven on purpose: rank 0 takes the first three samples (all image ones but the last)."""
    if world == 1:
        return list(range(n))
    return [0, 1, 2] if rank == 0 else list(range(3, n))


CASES = [
    ("grpo", "token-mean"),
    ("sft", "seq-mean-token-mean"),
    ("grpo", "seq-mean-token-sum-norm"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # fused AdamW: the optimizer step below takes the no-host-sync path (sharded grad norm,
    # device-side clip), which must agree across world sizes too
    optim = OptimConfig(lr=1e-2, weight_decay=0.0, fused=True)
    cfg: FsdpConfig = tiny_actor_config(max_tokens_per_gpu=64, optim=optim)
    actor = FsdpActor(cfg)
    batch = mixed_batch()
    part = batch.select(shard(len(batch), actor.rank, actor.world_size))
    logprobs = actor.compute_logprobs(part)
    gathered = [None] * actor.world_size
    torch.distributed.all_gather_object(gathered, logprobs)
    results = {"logprobs": [lp for rank_part in gathered for lp in rank_part]}
    for loss, agg in CASES:
        cfg.grpo.loss_agg_mode = agg
        cfg.sft_loss_agg_mode = agg
        metrics = actor.forward_backward(part, loss=loss)
        grads = actor.full_gradients()
        actor.zero_grad()
        results[(loss, agg)] = {"grads": grads, "metrics": metrics}
    metrics = actor.train_step(part, loss="sft")
    params = actor.full_parameters()
    results["train_step"] = {"grad_norm": metrics["grad_norm"], "params": params}
    if actor.rank == 0:
        torch.save(results, args.out)
    actor.close()


if __name__ == "__main__":
    main()
