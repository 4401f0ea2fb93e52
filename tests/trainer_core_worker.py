"""One rank of tests/test_trainer_core.py: the same GRPO step on the FSDP actor and on the
Megatron actor (TP=1 as two data-parallel ranks, TP=2 with sequence parallelism), float32 on
CPU over gloo, with one loss object; then a step whose gradient is not finite.

Usage: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python trainer_core_worker.py
out_dir``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vlm_models.megatron import _cpu_compat

if not torch.cuda.is_available():
    _cpu_compat.apply()

from rl_algos import GrpoLoss, GrpoLossConfig, TrainBatch
from trainers_fsdp import (
    TINY_OVERRIDES,
    FsdpActor,
    FsdpConfig,
    OptimConfig,
    synthetic_batch,
)
from trainers_megatron import MegatronActor, MegatronConfig
from vlm_models import tiny_config

# Adam's first step moves every weight by about the LR, whatever its gradient's size, so a
# gradient near 0 (where the backends' float32 roundings differ) moves by up to the LR on one
# and less on the other; 1e-4 keeps that inside the 1e-5 the weights must agree to.
LR = 1e-4
MAX_TOKENS = 64  # several micro-batches per rank
LOSS = GrpoLoss(GrpoLossConfig(eps_clip=0.1, eps_clip_high=0.1))


def the_batch() -> TrainBatch:
    """Four samples, three with an image; old log-probs are filled in by the worker."""
    config = tiny_config(**TINY_OVERRIDES)
    return synthetic_batch(
        config, [40, 24, 52, 30], image_patches=[(4, 4), None, (4, 6), (2, 2)], seed=3
    )


def build(name: str):
    if name == "fsdp":
        return FsdpActor(
            FsdpConfig(
                model="qwen3-vl-tiny",
                model_overrides=dict(TINY_OVERRIDES),
                device="cpu",
                max_tokens_per_gpu=MAX_TOKENS,
                optim=OptimConfig(lr=LR, weight_decay=0.0, max_grad_norm=1.0),
                log_entropy=False,
                export_dtype="float32",
            )
        )
    tp = 2 if name == "megatron_tp2" else 1
    return MegatronActor(
        MegatronConfig(
            model="qwen3-vl-tiny",
            model_overrides=dict(TINY_OVERRIDES),
            tp=tp,
            sp=tp > 1,
            max_tokens_per_gpu=MAX_TOKENS,
            lr=LR,
            weight_decay=0.0,
            max_grad_norm=1.0,
            export_dtype="float32",
        )
    )


def weights(actor) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in actor.iter_hf_weights(bucket_bytes=1 << 22):
        out.update({n: t.float().clone() for n, t in bucket})
    return out


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    batch = the_batch()
    results = {}
    for name in ("fsdp", "megatron_tp1", "megatron_tp2"):
        actor = build(name)
        # data parallel: each rank its half; TP=2: both ranks hold the whole batch
        idx = [0, 1, 2, 3] if name == "megatron_tp2" else [[0, 1], [2, 3]][rank]
        part = batch.select(idx)
        initial = weights(actor)
        before = actor.compute_logprobs(part)
        # old log-probs off the current ones (per sample, whatever the rank): ratios != 1
        old = [
            b + 0.2 * m * torch.randn(b.shape, generator=torch.Generator().manual_seed(100 + i))
            for i, b, m in zip(idx, before, part.loss_mask, strict=True)
        ]
        part = dataclasses.replace(part, old_logprobs=old)
        metrics = actor.train_step(part, loss=LOSS)
        after = weights(actor)
        bad = dataclasses.replace(part, advantages=[a * float("nan") for a in part.advantages])
        nonfinite = actor.train_step(bad, loss=LOSS)
        unchanged = all(torch.equal(after[k], v) for k, v in weights(actor).items())
        results[name] = dict(
            before=before,
            metrics=metrics,
            after=after,
            moved=max(float((after[k] - v).abs().max()) for k, v in initial.items()),
            nonfinite=nonfinite,
            unchanged=unchanged,
            step=actor.step,
        )
        dist.barrier()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
