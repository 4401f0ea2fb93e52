"""One training configuration measured, for ``bench_fsdp_train.py``: the bench batch and its
model FLOPs, the steps timed back to back and summarised (tokens/s per GPU, MFU by 6 * params
and by the model's FLOPs, peak memory), and an actor's diagnostics (``train_profile``). Each
function takes the bench's parsed arguments."""

from __future__ import annotations

import logging

import torch
from harness import mfu, peak_memory_gib, time_steps
from train_profile import log_host_phases, profile_step, timeline_steps, watch_host_phases

log = logging.getLogger("bench_fsdp_train")


def model_overrides(args) -> dict:
    """Tiny presets get a small vocabulary so the CPU run stays small; ``--layers`` cuts the
    shape (the config of ``preset_config(preset, num_hidden_layers=N)``)."""
    from trainers_fsdp.synthetic import TINY_OVERRIDES

    out = dict(TINY_OVERRIDES) if args.preset.endswith("tiny") else {}
    if args.layers:
        out["num_hidden_layers"] = args.layers
    return out


def model_flops_per_token(args, config) -> float:
    """Training FLOPs per token of one bench sample (:mod:`vlm_models.flops`: the language
    model's active matmuls and attention over the sample, plus the vision tower on its image),
    averaged over the sample's tokens."""
    from vlm_models.flops import flops_per_token, vision_flops

    side = args.image_size // config.vision_config.patch_size
    vision = vision_flops(config, [[1, side, side]]) / args.seq_len
    return flops_per_token(config, args.seq_len) + vision


def make_batch(args, config, n_samples: int, seed: int):
    from trainers_fsdp.synthetic import synthetic_batch

    patch = config.vision_config.patch_size
    side = args.image_size // patch
    return synthetic_batch(
        config,
        [args.seq_len] * n_samples,
        image_patches=[(side, side)] * n_samples,
        seed=seed,
        grpo=args.loss == "grpo",
    )


def tokens_per_step(args) -> int:
    """Tokens one GPU trains per optimizer step."""
    return args.accum * args.batch * args.seq_len


def measure(name: str, step, args, device: torch.device, params: int, config) -> dict:
    """``--warmup`` steps, then ``--steps`` back to back as in a training loop (the device
    synchronised only around them, ``--python-gc``'s collection), summarised: the step time
    is the run's wall time over its steps; MFU by 6 * params and by the model's FLOPs."""
    periodic = args.python_gc == "periodic"  # as rl_runtime.PeriodicGC runs the trainer
    times = time_steps(step, device, warmup=args.warmup, steps=args.steps, quiet_gc=periodic)
    tps = tokens_per_step(args) / times.mean
    out = {
        "step_time_s": times.mean,
        "step_times_s": list(times.times),
        "tokens_per_s_per_gpu": tps,
        "mfu": mfu(6 * params * tps),
        "mfu_flops": mfu(model_flops_per_token(args, config) * tps),
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = peak_memory_gib(device)
    log.info(
        "%-8s step %.3f s  %.0f tokens/s/GPU  MFU %.1f%% (model FLOPs %.1f%%)",
        name,
        times.mean,
        tps,
        100 * out["mfu"],
        100 * out["mfu_flops"],
    )
    return out


def measure_actor(name: str, args, device: torch.device, actor, model, config) -> tuple:
    """(result, step, params) of an actor's ``train_step`` on the bench batch: timed
    (:func:`measure`), with ``--host-phases`` its host time by phase, with ``--profile`` (rank
    0) one step profiled and the GPU's timeline of a few."""
    params = sum(p.numel() for p in model.parameters())
    batch = make_batch(args, config, args.batch * args.accum, seed=1 + actor.rank)
    metrics: dict = {}

    def step():
        metrics.update(actor.train_step(batch, loss=args.loss))

    phases = watch_host_phases(actor) if args.host_phases else None
    result = measure(name, step, args, device, params, config)
    if phases is not None:
        result["host_phases_ms"] = log_host_phases(phases[-args.steps :])
    result["last_metrics"] = metrics
    if args.profile and actor.rank == 0:
        profile_step(step, args.profile / f"profile_{name}.txt", device, model)
        if device.type == "cuda":
            timeline_steps(step, args.profile / f"timeline_{name}.txt")
    return result, step, params
