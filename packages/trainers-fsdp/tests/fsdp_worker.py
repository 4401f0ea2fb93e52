"""One rank of the multi-process tests: run as a script with torchrun-style env variables.

For each scenario of ``--case`` (a JSON object: name -> the scenario's flags, as the command
line below takes them), builds the tiny actor, takes this rank's shard of a fixed batch,
accumulates the gradient of the global-batch loss and keeps the full gradients and metrics;
rank 0 writes them, by scenario name, to ``--out``. One launch runs every scenario of a world
size, in one process group (the processes' imports cost more than a scenario).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import mixed_batch, tiny_actor_config
from trainers_fsdp import FsdpConfig, OptimConfig
from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.distributed import init_distributed


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


def scenario_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicate", action="store_true", help="FsdpConfig.replicate")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (float32 masters)")
    parser.add_argument("--reduce-dtype", default="float32", help="FsdpConfig.reduce_dtype")
    parser.add_argument("--checkpoint", default=None, help="save here, then resume a fresh actor")
    parser.add_argument("--model", default="qwen3-vl-tiny", help="a tiny preset")
    parser.add_argument(
        "--routing-replay", action="store_true", help="an MoE preset routed to random experts"
    )
    return parser


def run(args: argparse.Namespace) -> dict:
    """One scenario; rank 0's results (every rank's log-probs, its gradients and parameters)."""
    # fused AdamW: the optimizer step below takes the no-host-sync path (sharded grad norm,
    # device-side clip), which must agree across world sizes too
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    cfg: FsdpConfig = tiny_actor_config(
        model=args.model,
        max_tokens_per_gpu=64,
        optim=optim,
        fused_adamw=True,
        replicate=args.replicate,
        param_dtype="bfloat16" if args.bf16 else None,
        reduce_dtype=args.reduce_dtype,
        routing_replay=args.routing_replay,
    )
    actor = FsdpActor(cfg)
    batch = mixed_batch()
    if args.routing_replay:  # the same ids on every rank: drawn for the whole batch
        text = actor.model_config.text_config
        g = torch.Generator().manual_seed(0)
        shape = (text.num_hidden_layers, text.num_experts)
        batch.routed_experts = [
            torch.rand(n, *shape, generator=g).argsort(-1)[..., : text.num_experts_per_tok]
            for n in batch.lengths
        ]
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
    if args.checkpoint:  # the step after a save, by this actor and by a fresh one resumed
        actor.save_checkpoint(args.checkpoint)
        expected = actor.train_step(part, loss="sft")["loss"]
        fresh = FsdpActor(cfg)
        fresh.load_checkpoint(args.checkpoint)
        resumed = fresh.train_step(part, loss="sft")["loss"]
        after = (actor.full_parameters(), fresh.full_parameters())
        results["resume"] = {"losses": (expected, resumed), "params": after}
    actor.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True, help="JSON: scenario name -> its flags")
    args = parser.parse_args()
    scenarios = json.loads(args.case)
    # the group every scenario's actors share (an actor that finds one does not own it)
    init_distributed(torch.device("cpu"))
    results = {}
    for name, flags in scenarios.items():
        results[name] = run(scenario_parser().parse_args(flags))
    if torch.distributed.get_rank() == 0:
        torch.save(results, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is saved and the process group destroyed (actor.close). Interpreter
    # finalization can still abort a gloo rank now and then ("terminate called without an
    # active exception", about one CI run in three, never reproduced standalone): torch's
    # teardown, not this code, so the worker leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
