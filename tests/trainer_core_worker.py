"""One rank of tests/test_trainer_core.py: the same GRPO step on the FSDP actor and on the
Megatron actor in several layouts (``SCENARIOS``: data parallel with the distributed optimizer,
TP=2 with sequence parallelism, two pipeline stages, recomputation, MoE with expert
parallelism), float32 on CPU over gloo, with one loss object; then a step whose gradient is not
finite.

Usage: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python trainer_core_worker.py
out_dir``.
"""

from __future__ import annotations

import contextlib
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
from rl_algos.optimizer import OptimConfig
from trainers_fsdp import FsdpConfig
from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.synthetic import TINY_OVERRIDES, synthetic_batch
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor
from vlm_models.presets import tiny_config

# Adam's first step moves every weight by about the LR, whatever its gradient's size, so a
# gradient near 0 (where the backends' float32 roundings differ) moves by up to the LR on one
# and less on the other; 1e-4 keeps that inside the 1e-5 the weights must agree to.
LR = 1e-4
MAX_TOKENS = 64  # several micro-batches per rank
LOSS = GrpoLoss(GrpoLossConfig(eps_clip=0.1, eps_clip_high=0.1))
# the KL runs: an LR at which three steps leave the reference measurably (kl_loss ~1e-3)
KL_LR = 1e-3
KL_LOSS = GrpoLoss(GrpoLossConfig(eps_clip=0.2, eps_clip_high=0.2, kl_coef=0.01))


def the_batch() -> TrainBatch:
    """Four samples, three with an image; old log-probs are filled in by the worker."""
    config = tiny_config(**TINY_OVERRIDES)
    return synthetic_batch(
        config, [40, 24, 52, 30], image_patches=[(4, 4), None, (4, 6), (2, 2)], seed=3
    )


#: scenario -> (backend, model preset, actor settings, whether both ranks hold the whole batch)
SCENARIOS: dict[str, tuple[str, str, dict, bool]] = {
    "fsdp": ("fsdp", "qwen3-vl-tiny", {}, False),
    # two data-parallel ranks, megatron-core's distributed optimizer (the default)
    "megatron_tp1": ("megatron", "qwen3-vl-tiny", {}, False),
    # one replica over two TP ranks; megatron-core's non-distributed optimizer
    "megatron_tp2": (
        "megatron",
        "qwen3-vl-tiny",
        dict(tp=2, sp=True, distributed_optimizer=False),
        True,
    ),
    # one replica over two pipeline stages (3 + 1 layers: the deepstack layers on the first)
    "megatron_pp2": ("megatron", "qwen3-vl-tiny", dict(pp=2), True),
    # recomputation: the same gradients as none (megatron_tp1)
    "megatron_full": ("megatron", "qwen3-vl-tiny", dict(recompute="full"), False),
    "megatron_selective": ("megatron", "qwen3-vl-tiny", dict(recompute="selective"), False),
    # MoE: FSDP, and Megatron with the 8 experts split over the two data-parallel ranks
    "fsdp_moe": ("fsdp", "qwen3-vl-moe-tiny", {}, False),
    "megatron_moe_ep2": ("megatron", "qwen3-vl-moe-tiny", dict(ep=2), False),
}


def build(name: str, *, lr: float = LR, reference_model: bool = False):
    backend, preset, settings, _ = SCENARIOS[name]
    if backend == "fsdp":
        return FsdpActor(
            FsdpConfig(
                model=preset,
                model_overrides=dict(TINY_OVERRIDES),
                device="cpu",
                max_tokens_per_gpu=MAX_TOKENS,
                optim=OptimConfig(lr=lr, weight_decay=0.0, max_grad_norm=1.0),
                log_entropy=False,
                export_dtype="float32",
                reference_model=reference_model,
            )
        )
    return MegatronActor(
        MegatronConfig(
            model=preset,
            model_overrides=dict(TINY_OVERRIDES),
            max_tokens_per_gpu=MAX_TOKENS,
            optim=OptimConfig(lr=lr, weight_decay=0.0, max_grad_norm=1.0),
            export_dtype="float32",
            reference_model=reference_model,
            **settings,
        )
    )


def local_grads(actor) -> dict[str, torch.Tensor]:
    """This rank's gradients before any reduction (megatron-core's ``main_grad`` buffers)."""
    return {n: p.main_grad.clone() for n, p in actor.module.named_parameters()}


@contextlib.contextmanager
def count_core_attention(actor):
    """How often the decoder's core attention runs (recomputation runs it again in backward)."""
    calls = [0]

    def count(*_):
        calls[0] += 1

    layers = actor.module.language_model.decoder.layers
    hooks = [layer.self_attention.core_attention.register_forward_hook(count) for layer in layers]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def optimizer_numel(actor) -> tuple[int, int]:
    """(AdamW moment elements this rank holds, trainable parameter elements of its model)."""
    from trainers_megatron.optim import optimizers

    held = sum(
        int(state["exp_avg"].numel())
        for opt in optimizers(actor.optimizer)
        for state in opt.optimizer.state.values()
    )
    return held, sum(p.numel() for p in actor.module.parameters() if p.requires_grad)


def weights(actor) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in actor.iter_hf_weights(bucket_bytes=1 << 22):
        out.update({n: t.float().clone() for n, t in bucket})
    return out


def kl_steps(name: str, batch: TrainBatch, steps: int = 3) -> list[dict[str, float]]:
    """``steps`` on-policy GRPO steps with a KL penalty to the frozen initial weights, the
    reference log-probs taken as the loop takes them (``compute_logprobs(reference=True)``)."""
    actor = build(name, lr=KL_LR, reference_model=True)
    out = []
    for _ in range(steps):
        part = dataclasses.replace(
            batch,
            old_logprobs=actor.compute_logprobs(batch),
            ref_logprobs=actor.compute_logprobs(batch, reference=True),
        )
        out.append(actor.train_step(part, loss=KL_LOSS))
    del actor
    dist.barrier()
    return out


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    batch = the_batch()
    results = {}
    for name, (backend, *_, whole) in SCENARIOS.items():
        actor = build(name)
        # data parallel: each rank its half; one replica (TP, PP): both ranks hold it all
        idx = [0, 1, 2, 3] if whole else [[0, 1], [2, 3]][rank]
        part = batch.select(idx)
        initial = weights(actor)
        before = actor.compute_logprobs(part)
        # old log-probs off the current ones (per sample, whatever the rank): ratios != 1
        old = [
            b + 0.2 * m * torch.randn(b.shape, generator=torch.Generator().manual_seed(100 + i))
            for i, b, m in zip(idx, before, part.loss_mask, strict=True)
        ]
        part = dataclasses.replace(part, old_logprobs=old)
        result: dict = dict(before=before)
        if backend == "megatron" and not whole:  # the step in two halves, gradients between
            with count_core_attention(actor) as calls:
                halves = actor.forward_backward(part, loss=LOSS)
            result.update(grads=local_grads(actor), attention_calls=calls[0])
            metrics = {**halves, **actor.optimizer_step()}
            result["optimizer_numel"] = optimizer_numel(actor)
        else:
            metrics = actor.train_step(part, loss=LOSS)
        after = weights(actor)
        bad = dataclasses.replace(part, advantages=[a * float("nan") for a in part.advantages])
        nonfinite = actor.train_step(bad, loss=LOSS)
        unchanged = all(torch.equal(after[k], v) for k, v in weights(actor).items())
        if backend == "megatron":
            mlp = actor.module.language_model.decoder.layers[0].mlp
            result["local_experts"] = len(
                getattr(getattr(mlp, "experts", None), "local_experts", [])
            )
        results[name] = dict(
            result,
            metrics=metrics,
            after=after,
            moved=max(float((after[k] - v).abs().max()) for k, v in initial.items()),
            nonfinite=nonfinite,
            unchanged=unchanged,
            step=actor.step,
        )
        del actor
        dist.barrier()
    half = batch.select([[0, 1], [2, 3]][rank])
    results["kl"] = {name: kl_steps(name, half) for name in ("fsdp", "megatron_tp1")}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
