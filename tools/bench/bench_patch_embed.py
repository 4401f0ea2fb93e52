"""Qwen3-VL patch embedding: Conv3d (HF) vs the GEMM over the same weights (vlm_models).

Two measurements, baseline and ours in the same run on the same weights, ratio printed:

1. the patch embedding alone: ``--patches`` flattened 3x2x16x16 patches (default 16,384) into
   the vision width of ``--shape``, forward and forward + backward;
2. the whole vision tower of ``--shape`` (default the 2B/4B tower: depth 24, width 1024) on
   ``--images`` random images of ``--image-size`` pixels (default 8 x 512x512 = 8,192 patches),
   forward and forward + backward, switching only the patch embedding.

On CPU the defaults shrink (``--patches 2048``, 2 images of 256 px, ``--depth 2``) so it
finishes in seconds; pass the flags to override.

    uv run python tools/bench/bench_patch_embed.py --device cpu --out /tmp/patch_embed.json
    PYTHONPATH=packages/vlm-models/src python tools/bench/bench_patch_embed.py \\
        --device cuda --out patch_embed_h200.json
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from harness import device_name, time_calls, workspace_paths, write_json

sys.path.extend(workspace_paths())  # a checkout without the workspace installed
import vlm_models
from vlm_models.classes import select_classes
from vlm_models.patch_embed import Conv3dPatchEmbed, LinearPatchEmbed
from vlm_models.presets import preset_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` in milliseconds (synchronised on CUDA)."""
    return 1e3 * time_calls(fn, device, warmup=warmup, repeats=iters).median


def bench_pair(
    name: str,
    run: Callable[[bool], object],
    device: torch.device,
    warmup: int,
    iters: int,
) -> dict[str, float]:
    """Time ``run(fast=False)`` (Conv3d) and ``run(fast=True)`` (GEMM), interleaved per call."""
    conv = time_ms(lambda: run(False), device, warmup, iters)
    linear = time_ms(lambda: run(True), device, warmup, iters)
    # Second pass of the baseline guards against warm-up order effects (cuDNN autotune).
    conv = min(conv, time_ms(lambda: run(False), device, 1, iters))
    result = {"conv3d_ms": conv, "linear_ms": linear, "speedup": conv / linear}
    print(f"{name:<34} conv3d {conv:9.3f} ms   linear {linear:9.3f} ms   x{conv / linear:6.2f}")
    return result


def bench_patch_embed(args, device, dtype, vision_width: int) -> dict:
    torch.manual_seed(0)
    proj = torch.nn.Conv3d(3, vision_width, kernel_size=(2, 16, 16), stride=(2, 16, 16))
    proj = proj.to(device=device, dtype=dtype)
    modules = {False: Conv3dPatchEmbed(proj), True: LinearPatchEmbed(proj)}
    x = torch.randn(args.patches, 3 * 2 * 16 * 16, device=device, dtype=dtype)
    with torch.no_grad():
        ref, ours = modules[False](x).float(), modules[True](x).float()
    max_abs = (ref - ours).abs().max().item()
    scale = ref.abs().max().item()
    print(
        f"patch embed: {args.patches} patches -> {vision_width}, max |diff| {max_abs:.3g} "
        f"(output max {scale:.3g})"
    )

    def forward(fast: bool):
        with torch.no_grad():
            return modules[fast](x)

    x_grad = x.clone().requires_grad_(True)

    def forward_backward(fast: bool):
        proj.zero_grad(set_to_none=True)
        modules[fast](x_grad).float().square().mean().backward()

    return {
        "patches": args.patches,
        "embed_dim": vision_width,
        "max_abs_diff": max_abs,
        "output_abs_max": scale,
        "forward": bench_pair("patch embed forward", forward, device, args.warmup, args.iters),
        "forward_backward": bench_pair(
            "patch embed forward+backward", forward_backward, device, args.warmup, args.iters
        ),
    }


def build_vision_tower(args, device, dtype):
    from transformers import AutoModel

    config = preset_config(args.shape)
    vision_config = config.vision_config
    if args.depth is not None:
        vision_config.depth = args.depth
        vision_config.deepstack_visual_indexes = [
            i for i in vision_config.deepstack_visual_indexes if i < args.depth
        ] or [args.depth - 1]
    vision_config._attn_implementation = args.attn
    torch.manual_seed(0)
    tower = AutoModel.from_config(vision_config, dtype=dtype, attn_implementation=args.attn)
    return tower.to(device), vision_config


def bench_vision_tower(args, device, dtype) -> dict:
    tower, vc = build_vision_tower(args, device, dtype)
    side = args.image_size // vc.patch_size
    grid = torch.tensor([[1, side, side]] * args.images, device=device)
    n_patches = int(grid.prod(-1).sum())
    pixels = torch.randn(n_patches, 3 * 2 * 16 * 16, device=device, dtype=dtype)
    print(
        f"vision tower {args.shape} depth {vc.depth} width {vc.hidden_size} attn {args.attn}: "
        f"{args.images} images {args.image_size}px = {n_patches} patches"
    )

    def forward(fast: bool):
        select_classes(tower, fast_patch_embed=fast)  # the model file's GEMM class, or Conv3d
        with torch.no_grad():
            return tower(pixels, grid_thw=grid).pooler_output

    with torch.no_grad():
        ref, ours = forward(False).float(), forward(True).float()
    max_abs = (ref - ours).abs().max().item()
    print(f"vision tower: max |diff| {max_abs:.3g} (output max {ref.abs().max().item():.3g})")

    def forward_backward(fast: bool):
        select_classes(tower, fast_patch_embed=fast)
        tower.zero_grad(set_to_none=True)
        tower(pixels, grid_thw=grid).pooler_output.float().square().mean().backward()

    return {
        "shape": args.shape,
        "depth": vc.depth,
        "width": vc.hidden_size,
        "attn_implementation": args.attn,
        "images": args.images,
        "image_size": args.image_size,
        "patches": n_patches,
        "max_abs_diff": max_abs,
        "forward": bench_pair("vision tower forward", forward, device, args.warmup, args.iters),
        "forward_backward": bench_pair(
            "vision tower forward+backward", forward_backward, device, args.warmup, args.iters
        ),
    }


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vlm_models": str(Path(vlm_models.__file__).parent),
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = device_name(device)
        env["cudnn"] = torch.backends.cudnn.version()
        env["cuda"] = torch.version.cuda
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--shape", default="qwen3-vl-2b", help="preset whose vision tower to use")
    parser.add_argument("--patches", type=int, help="patch-embed-only patches (16384; CPU 2048)")
    parser.add_argument("--images", type=int, help="images through the tower (8; CPU 2)")
    parser.add_argument("--image-size", type=int, help="square image side in px (512; CPU 256)")
    parser.add_argument("--depth", type=int, help="override the tower depth (CPU default 2)")
    parser.add_argument("--attn", default="sdpa", help="vision attention implementation")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, help="timed iterations (50; CPU 5)")
    parser.add_argument("--skip-tower", action="store_true", help="patch embedding only")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    args.patches = args.patches or (2048 if on_cpu else 16384)
    args.images = args.images or (2 if on_cpu else 8)
    args.image_size = args.image_size or (256 if on_cpu else 512)
    args.iters = args.iters or (5 if on_cpu else 50)
    if args.depth is None and on_cpu:
        args.depth = 2
    dtype = DTYPES[args.dtype]
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False  # the HF default; what users run

    vision_width = preset_config(args.shape).vision_config.hidden_size
    results = {
        "benchmark": "patch_embed",
        "dtype": args.dtype,
        "environment": environment(device),
        "patch_embed": bench_patch_embed(args, device, dtype, vision_width),
    }
    if not args.skip_tower:
        results["vision_tower"] = bench_vision_tower(args, device, dtype)
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
