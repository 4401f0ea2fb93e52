"""The one-rank optimizer step: torch's AdamW over the master weights vs FlatAdamW.

Both run the FSDP actor's sequence after a backward of one micro-batch, in the same process on
parameters of a named shape (random values): the gradient norm, its host read, the clipped AdamW
step and the cast into the bf16 weights, and zeroing the gradients.

- baseline (``FsdpConfig(flat_update=False)``): the bf16 gradient moved into float32, the
  norm per tensor, torch's fused AdamW (foreach on CPU) over the float32 masters, one cast pass;
- ours (the CUDA default): :class:`trainers_fsdp.flat_adamw.FlatAdamW`, the norm and one
  compiled pass per group that reads the bf16 gradient and writes masters, moments and bf16
  weights. On the CPU that pass runs uncompiled and is slower than torch's foreach AdamW, which
  is why the actor uses it on CUDA only.

CPU (small):  uv run python tools/bench/bench_flat_adamw.py --device cpu
H200:         PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_flat_adamw.py \\
                  --device cuda --out flat_adamw.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from harness import device_name, release, time_calls, write_json

log = logging.getLogger("bench_flat_adamw")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default=None, help="model shape (qwen3-vl-2b on CUDA, tiny on CPU)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.preset = args.preset or ("qwen3-vl-2b" if args.device == "cuda" else "qwen3-vl-tiny")
    return args


def build_masters(preset: str, device: torch.device):
    """MasterWeights over a model of ``preset``'s shapes, materialised on ``device`` with
    random values (no checkpoint: only the shapes matter here)."""
    from trainers_fsdp.master import MasterWeights
    from vlm_models.build import build_model

    with torch.device("meta"):
        model = build_model(preset, dtype=torch.float32)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty materialises a tied weight twice
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return MasterWeights(model, torch.bfloat16, device)


def time_config(args, device: torch.device, flat: bool) -> dict:
    from rl_algos.optimizer import OptimConfig
    from trainers_fsdp.flat_adamw import FlatAdamW
    from trainers_fsdp.optim import (
        build_optimizer,
        clip_coefficient,
        grad_norm,
        step_with_scaled_grads,
    )

    masters = build_masters(args.preset, device)
    cfg = OptimConfig(lr=1e-6, weight_decay=0.01, max_grad_norm=1.0)
    optimizer = build_optimizer(masters.module, cfg, device, masters, flat_update=flat)
    assert isinstance(optimizer, FlatAdamW) and optimizer.is_flat == flat
    gen = torch.Generator(device=device).manual_seed(0)

    def backward() -> None:  # stands in for one micro-batch's backward (the same for both)
        masters.before_backward()
        masters.compute_grad.normal_(0.0, 1e-3, generator=gen)

    def step() -> None:  # FsdpActor.train_step after its backward
        if flat:
            norm = optimizer.grad_norm()
        else:
            masters.ready_grads()
            norm = grad_norm(masters.module.parameters())
        step_with_scaled_grads(optimizer, clip_coefficient(float(norm), cfg.max_grad_norm))
        masters.zero_grad()

    timing = time_calls(step, device, warmup=args.warmup, repeats=args.steps, before=backward)
    name = "ours" if flat else "baseline"
    ms = 1e3 * timing.median
    log.info(
        "%-8s %.2f ms per optimizer step (%.1fM params)", name, ms, masters.num_trainable / 1e6
    )
    return {"step_ms": ms, "step_times_ms": [1e3 * t for t in timing.times]}


def measure(args, device: torch.device, flat: bool) -> dict:
    """One configuration's times and, on CUDA, its peak memory (then released for the next)."""
    out = time_config(args, device, flat)
    peak = release(device)
    return out if peak is None else out | {"peak_memory_gib": peak}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    device = torch.device(args.device)
    baseline = measure(args, device, flat=False)
    ours = measure(args, device, flat=True)
    ratio = baseline["step_ms"] / ours["step_ms"]
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "preset": args.preset,
        "baseline": baseline,
        "ours": ours,
        "speedup": ratio,
    }
    print(
        f"baseline {baseline['step_ms']:.2f} ms | ours {ours['step_ms']:.2f} ms | "
        f"speedup {ratio:.2f}x"
    )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
