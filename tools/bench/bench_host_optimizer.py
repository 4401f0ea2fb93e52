"""The Megatron backend's host optimizer step: megatron-core's own vs in pieces (ours).

Both step the same megatron-core ``HybridDeviceOptimizer``, built as ``get_megatron_optimizer``
builds it under ``--optimizer-cpu-offload`` (torch's fused AdamW on float32 host copies, one
optimizer per parameter, ``overlap_cpu_optimizer_d2h_h2d``), over bf16 parameter shards of a
named model's decoder-layer shapes with float32 gradients on the device (what the distributed
optimizer hands it as ``decoupled_grad``), everything offloaded:

- baseline: megatron-core 0.16.1's ``HybridDeviceOptimizer.step`` (every gradient copied into
  pageable host memory first, then each parameter's AdamW and its weights' copy back);
- ours: :func:`trainers_megatron.host_step.step_in_pieces`, the same AdamW through
  :class:`trainer_core.host_adamw.HostAdamW` (pieces through pinned buffers, copies overlapped
  with the CPU's step), the FSDP backend's host step.

The floor beside them: the host step reads the gradient and the masters and moments and writes
them back (28 bytes a parameter through host memory, against the copy bandwidth measured
here), and 6 bytes a parameter cross PCIe (float32 down, bf16 up, against the pinned copy
bandwidth measured here on a GPU); overlapped, the slower bounds the step, and the bench prints
ours as a fraction of that floor. On the CPU both copies are plain memory copies, so only the
GPU shows what the pinned, overlapped copies gain.

CPU (small):  uv run python tools/bench/bench_host_optimizer.py --device cpu
H200 (8B's layers, 36 of them: about 7.6B parameters, 120 GB of host state; --layers to cut):
  PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:) \\
    python3 tools/bench/bench_host_optimizer.py --device cuda --layers 8 --out host_optimizer.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from harness import copy_bandwidth_gb_s, device_name, event_seconds, time_calls, write_json

log = logging.getLogger("bench_host_optimizer")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="qwen3-vl-8b", help="whose decoder-layer shapes")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (CUDA 8, CPU 1)")
    p.add_argument("--width", type=float, default=None, help="shapes scaled (CUDA 1, CPU 0.25)")
    p.add_argument("--threads", type=int, default=None, help="host threads (default: every core)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.layers = args.layers or (8 if cuda else 1)
    args.width = args.width or (1.0 if cuda else 0.25)
    return args


def layer_shapes(preset: str, width: float) -> list[int]:
    """Element counts of one decoder layer's tensors (attention, MLP, norms)."""
    from vlm_models.presets import preset_config

    text = preset_config(preset).text_config
    h = int(text.hidden_size * width)
    inter = int(text.intermediate_size * width)
    heads, kv, dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    q, k = int(heads * dim * width), int(kv * dim * width)
    return [q * h, k * h, k * h, h * q, inter * h, inter * h, h * inter, h, h]


def build(args, device: torch.device):
    """A HybridDeviceOptimizer with everything offloaded, as megatron-core builds it."""
    if device.type == "cpu":
        from vlm_models.megatron import apply_cpu_compat

        apply_cpu_compat()
    import megatron.core.optimizer as mcore_optimizer

    from trainers_megatron.optim import exact_pinned_masters

    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(args.layers):
        for n in layer_shapes(args.preset, args.width):
            p = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device=device))
            p.data.normal_(0.0, 0.02, generator=gen)
            p.decoupled_grad = torch.empty(n, dtype=torch.float32, device=device)
            p.decoupled_grad.normal_(0.0, 1e-3, generator=gen)
            params.append(p)
    hybrid = mcore_optimizer.HybridDeviceOptimizer(
        [{"params": params, "wd_mult": 1.0, "lr_mult": 1.0}],
        offload_fraction=1.0,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        overlap_cpu_optimizer_d2h_h2d=True,
        pin_cpu_grads=False,  # as trainers_megatron.optim.build_optimizer sets them
        pin_cpu_params=device.type == "cuda",
        param_update_in_fp32=True,
        lr=1e-6,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        fused=True,
    )
    exact_pinned_masters(hybrid)
    return hybrid, sum(p.numel() for p in params)


def pcie_gb_s(device: torch.device, gib: float = 1.0, repeats: int = 3) -> float | None:
    """Pinned host-to-device and device-to-host copy bandwidth (GB/s, the slower direction);
    None off CUDA."""
    if device.type != "cuda":
        return None
    n = int(gib * 2**30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    down = min(event_seconds(lambda: host.copy_(dev, non_blocking=True)) for _ in range(repeats))
    up = min(event_seconds(lambda: dev.copy_(host, non_blocking=True)) for _ in range(repeats))
    return n / max(down, up) / 1e9


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    device = torch.device(args.device)
    from trainer_core import host_threads
    from trainers_megatron.host_step import host_adamw_for, step_in_pieces

    hybrid, n = build(args, device)
    adamw = host_adamw_for(hybrid, args.threads)
    result: dict = {"device": device_name(device), "torch": torch.__version__, "params": n}
    with host_threads(args.threads):
        result["host_copy_gb_s"] = copy_bandwidth_gb_s("cpu", 1.0, 3)
    result["pcie_gb_s"] = pcie = pcie_gb_s(device)
    with host_threads(args.threads):
        for name, step in (
            ("baseline", hybrid.step),
            ("ours", lambda: step_in_pieces(hybrid, adamw, None)),
        ):
            timing = time_calls(step, device, warmup=args.warmup, repeats=args.steps)
            ms = 1e3 * timing.median
            result[name] = {"step_ms": ms, "step_times_ms": [1e3 * t for t in timing.times]}
            log.info("%-8s %.1f ms per step, %.2f ns a parameter", name, ms, 1e6 * ms / n)
    # the copies overlap the CPU's step at best: the slower of the two bounds the step
    host_ms = 1e3 * 28 * n / (result["host_copy_gb_s"] * 1e9)
    pcie_ms = None if pcie is None else 1e3 * 6 * n / (pcie * 1e9)
    floor_ms = max(host_ms, pcie_ms or 0.0)
    result |= {"host_memory_floor_ms": host_ms, "pcie_floor_ms": pcie_ms, "floor_ms": floor_ms}
    result["speedup"] = result["baseline"]["step_ms"] / result["ours"]["step_ms"]
    result["ours_of_floor"] = floor_ms / result["ours"]["step_ms"]
    pcie_note = "" if pcie is None else f", PCIe {pcie_ms:.1f} ms at {pcie:.0f} GB/s"
    print(
        f"{n / 1e6:.0f}M params: baseline {result['baseline']['step_ms']:.1f} ms | ours "
        f"{result['ours']['step_ms']:.1f} ms | speedup {result['speedup']:.2f}x | floor "
        f"{floor_ms:.1f} ms ({result['ours_of_floor']:.0%} of it; host memory {host_ms:.1f} ms "
        f"at {result['host_copy_gb_s']:.0f} GB/s copy{pcie_note})"
    )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
