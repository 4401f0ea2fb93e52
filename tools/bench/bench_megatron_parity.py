"""Megatron-Core Qwen3-VL vs transformers Qwen3-VL: logit parity and forward time, same weights.

Both models are built in the same process from one named shape at random init (``--preset``):
the HF ``Qwen3VLForConditionalGeneration`` (sdpa attention) is the baseline; ours is
``vlm_models.megatron`` (native Megatron decoder, TP=1, local spec, SDPA core attention, the
HF vision tower) loaded from the HF weights. Inputs are synthetic: ``--batch`` samples of
``--seq-len`` tokens, each with one ``--image-size`` square image of random pixels.

Reported: max and mean |logit difference| (ours vs baseline, in ``--dtype``), the same for the
HF model in ``--dtype`` vs HF in float32 (the precision noise floor), and the forward time of
both with their ratio. Rank 0 writes ``--out`` JSON.

CPU (small, float32):  uv run python tools/bench/bench_megatron_parity.py --device cpu \\
                           --out /tmp/megatron_parity.json
H200 (2B, bfloat16):   PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \\
                           python tools/bench/bench_megatron_parity.py --device cuda \\
                           --out megatron_parity.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from harness import fill_unset, time_calls, write_json

log = logging.getLogger("bench_megatron_parity")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default=None, help="shape (default qwen3-vl-2b CUDA, tiny CPU)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="bfloat16 CUDA, float32 CPU")
    p.add_argument("--batch", type=int, default=None, help="samples (default 4 CUDA, 2 CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens/sample (2048 CUDA, 128 CPU)")
    p.add_argument("--image-size", type=int, default=None, help="pixels (512 CUDA, 64 CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed forwards (5 CUDA, 1 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON result path")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    fill_unset(
        args,
        preset="qwen3-vl-2b" if cuda else "qwen3-vl-tiny",
        dtype="bfloat16" if cuda else "float32",
        batch=4 if cuda else 2,
        seq_len=2048 if cuda else 128,
        image_size=512 if cuda else 64,
        repeats=5 if cuda else 1,
    )
    return args


def synthetic_batch(config, batch: int, seq_len: int, image_size: int, device, seed: int):
    """Token ids with one image block per sample, matching pixel values and grids."""
    vision = config.vision_config
    grid = image_size // vision.patch_size
    n_image = grid * grid // vision.spatial_merge_size**2
    if n_image + 8 > seq_len:
        raise ValueError(f"--seq-len {seq_len} too short for {n_image} image tokens")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150000, (batch, seq_len), generator=gen)
    start = 4
    ids[:, start - 1] = config.vision_start_token_id
    ids[:, start : start + n_image] = config.image_token_id
    ids[:, start + n_image] = config.vision_end_token_id
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * grid * grid, patch_dim, generator=gen)
    grids = torch.tensor([[1, grid, grid]] * batch)
    mm_types = (ids == config.image_token_id).int()
    return ids.to(device), pixels.to(device), grids.to(device), mm_types.to(device)


def timed(fn, repeats: int, device: str) -> tuple[torch.Tensor, float]:
    """The output of a warm-up call, and the mean seconds of ``repeats`` more."""
    out = fn()
    return out, time_calls(fn, device, repeats=repeats).mean


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dtype = DTYPES[args.dtype]
    if not args.device.startswith("cuda"):
        from vlm_models.megatron import _cpu_compat

        _cpu_compat.apply()
    from vlm_models.build import build_model
    from vlm_models.megatron import (
        Parallelism,
        build_megatron_model,
        initialize_model_parallel,
        load_hf_weights,
        rope_position_ids,
    )
    from vlm_models.presets import preset_config

    torch.manual_seed(args.seed)
    initialize_model_parallel(Parallelism(), seed=args.seed)
    config = preset_config(args.preset)
    ids, pixels, grids, mm_types = synthetic_batch(
        config, args.batch, args.seq_len, args.image_size, args.device, args.seed
    )
    hf = build_model(config, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    ours = build_megatron_model(config, Parallelism(), params_dtype=dtype).to(args.device).eval()
    load_hf_weights(ours, hf.state_dict())
    positions = rope_position_ids(ids, config, mm_token_type_ids=mm_types, image_grid_thw=grids).to(
        args.device
    )
    hf_inputs = dict(
        input_ids=ids, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm_types
    )

    with torch.no_grad():
        expected, t_hf = timed(lambda: hf(**hf_inputs).logits, args.repeats, args.device)
        got, t_ours = timed(
            lambda: ours(ids, positions, pixel_values=pixels, image_grid_thw=grids),
            args.repeats,
            args.device,
        )
        diff = (got.float() - expected.float()).abs()
        del got
        noise = None
        if dtype != torch.float32:  # the precision floor: HF in dtype vs HF in float32
            hf.float()
            reference = hf(**hf_inputs).logits
            noise = (expected.float() - reference).abs()
            del reference
    result = dict(
        preset=args.preset,
        device=args.device,
        dtype=args.dtype,
        batch=args.batch,
        seq_len=args.seq_len,
        image_size=args.image_size,
        max_abs_logit_diff=float(diff.max()),
        mean_abs_logit_diff=float(diff.mean()),
        max_abs_logit=float(expected.float().abs().max()),
        hf_dtype_vs_fp32_max=None if noise is None else float(noise.max()),
        hf_dtype_vs_fp32_mean=None if noise is None else float(noise.mean()),
        forward_s_hf=t_hf,
        forward_s_megatron=t_ours,
        speed_ratio_hf_over_megatron=t_hf / t_ours,
    )
    print(
        f"{args.preset} {args.dtype} on {args.device}: |megatron - hf| max "
        f"{result['max_abs_logit_diff']:.3e} mean {result['mean_abs_logit_diff']:.3e} "
        f"(hf {args.dtype} vs fp32: max {result['hf_dtype_vs_fp32_max']} mean "
        f"{result['hf_dtype_vs_fp32_mean']}); forward hf {t_hf * 1e3:.1f} ms, megatron "
        f"{t_ours * 1e3:.1f} ms, ratio {result['speed_ratio_hf_over_megatron']:.2f}"
    )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
