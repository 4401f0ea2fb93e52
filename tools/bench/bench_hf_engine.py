"""HF rollout engine vs plain ``model.generate``: decode throughput, same model, same run.

A Qwen3-VL-shaped model with random weights (no download), synthetic prompts of
``--prompt-len`` tokens that each include one image (random pixels, a real Qwen3-VL vision
grid), ``--new-tokens`` sampled tokens per prompt with EOS ignored so every row runs to the
end. Both sides sample at temperature 1 with no top-k/top-p; ours also returns the log-prob of
every token. Prints tokens/s of each and the ratio; ``--out`` writes the figures as JSON.

Runs with only ``packages/*/src`` on PYTHONPATH (torch, transformers; no datasets):

    # GPU (H200): Qwen3-VL-2B shapes, batch 64 and 256, 400-token prompts, 256 new tokens
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_hf_engine.py \
        --device cuda --out bench_hf_engine.json
    # CPU smoke run (tiny model, small shapes)
    uv run python tools/bench/bench_hf_engine.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from typing import Any

import torch
import transformers

from rollout_sglang import GenerateRequest, HFEngine, SamplingParams
from vlm_models import build_model

logger = logging.getLogger("bench_hf_engine")


def synthetic_requests(
    config: Any, n: int, prompt_len: int, image_side: int, seed: int
) -> list[GenerateRequest]:
    """Chat-shaped prompts: <im_start>user\\n<vision_start><image_pad>*k<vision_end> text...
    <im_end>\\n<im_start>assistant\\n, exactly ``prompt_len`` tokens, one image each."""
    vision = config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    side = image_side // (patch * merge) * merge  # patches per side, a multiple of merge
    grid = torch.tensor([[1, side, side]])
    n_patches = side * side
    n_image_tokens = n_patches // merge**2
    patch_dim = vision.in_channels * vision.temporal_patch_size * patch * patch
    im_start, im_end, newline = 151644, 151645, 198  # Qwen chat tokens
    head = [im_start, 872, newline, config.vision_start_token_id]
    head += [config.image_token_id] * n_image_tokens + [config.vision_end_token_id]
    tail = [im_end, newline, im_start, 77091, newline]
    n_text = prompt_len - len(head) - len(tail)
    if n_text < 1:
        raise ValueError(f"--prompt-len {prompt_len} too short for a {image_side}px image")
    g = torch.Generator().manual_seed(seed)
    vocab = min(config.get_text_config().vocab_size, 150000)
    requests = []
    for i in range(n):
        text = torch.randint(1000, vocab, (n_text,), generator=g).tolist()
        ids = torch.tensor(head + text + tail)
        requests.append(
            GenerateRequest(
                input_ids=ids,
                pixel_values=torch.randn(n_patches, patch_dim, generator=g),
                image_grid_thw=grid.clone(),
                mm_token_type_ids=(ids == config.image_token_id).long(),
                request_id=str(i),
            )
        )
    return requests


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(model, requests, new_tokens: int, device) -> float:
    engine = HFEngine(model, device=device, max_batch_size=len(requests))
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    sync(device)
    start = time.perf_counter()
    out = engine.generate(requests, params)
    sync(device)
    elapsed = time.perf_counter() - start
    bad = [c.error for c in out if not c.ok or c.response_length != new_tokens]
    if bad:
        raise RuntimeError(f"HF engine: {len(bad)} incomplete completions, e.g. {bad[0]}")
    return elapsed


@torch.inference_mode()
def run_generate(model, requests, new_tokens: int, device) -> float:
    """Plain ``model.generate`` on the same batch (same length prompts: no padding needed)."""
    inputs = {
        "input_ids": torch.stack([r.input_ids for r in requests]).to(device),
        "attention_mask": torch.ones(
            len(requests), requests[0].prompt_length, dtype=torch.long, device=device
        ),
        "pixel_values": torch.cat([r.pixel_values for r in requests]).to(device),
        "image_grid_thw": torch.cat([r.image_grid_thw for r in requests]).to(device),
        "mm_token_type_ids": torch.stack([r.mm_token_type_ids for r in requests]).to(device),
    }
    torch.manual_seed(0)
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        **inputs,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # no early EOS, as ignore_eos on our side
        pad_token_id=0,
    )
    sync(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] != requests[0].prompt_length + new_tokens:
        raise RuntimeError(f"model.generate returned {tuple(out.shape)}")
    return elapsed


def step_ms(total_s: float, first_token_s: float, new_tokens: int) -> float:
    """Milliseconds per decode step: the time beyond the first token, over the other tokens."""
    return (total_s - first_token_s) / max(new_tokens - 1, 1) * 1e3


def profile_decode(model, device, prompt_len: int, image_side: int, path: str) -> None:
    """Top device/host ops of 32 decode steps at batch 64, ours and model.generate, to see where
    a per-step gap comes from (slow under the profiler: give it minutes on a 2B model)."""
    from torch.profiler import ProfilerActivity, profile

    requests = synthetic_requests(model.config, 64, prompt_len, image_side, seed=7)
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    out = []
    for name, fn in [
        ("ours", lambda: run_ours(model, requests, 32, device)),
        ("generate", lambda: run_generate(model, requests, 32, device)),
    ]:
        fn()  # warm
        with profile(activities=acts) as prof:
            elapsed = fn()
        out.append(f"===== {name}: {elapsed:.3f} s for 32 new tokens at batch 64")
        for key in ("self_cuda_time_total", "cpu_time_total"):
            out.append(
                prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
            )
    with open(path, "w") as f:
        f.write("\n".join(out))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset",
        default=None,
        help="vlm_models preset (default: qwen3-vl-2b on cuda, qwen3-vl-tiny on cpu)",
    )
    parser.add_argument(
        "--batch-sizes", default=None, help="comma list (default: 64,256 on cuda; 2,4 on cpu)"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens incl. the image (default 400 cuda, 64 cpu)",
    )
    parser.add_argument(
        "--image-side",
        type=int,
        default=None,
        help="image side in pixels (default 448 cuda, 128 cpu)",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens per response (default 256 cuda, 16 cpu)",
    )
    parser.add_argument(
        "--dtype", default=None, help="bfloat16 (cuda default) or float32 (cpu default)"
    )
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the text model")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per side, best kept (default 1 cuda, 3 cpu)",
    )
    parser.add_argument("--skip-baseline", action="store_true", help="only time the HF engine")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--profile", default=None, help="profile 32 decode steps, tables here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    preset = args.preset or ("qwen3-vl-2b" if gpu else "qwen3-vl-tiny")
    batch_sizes = [int(b) for b in (args.batch_sizes or ("64,256" if gpu else "2,4")).split(",")]
    prompt_len = args.prompt_len or (400 if gpu else 64)
    image_side = args.image_side or (448 if gpu else 128)
    new_tokens = args.new_tokens or (256 if gpu else 16)
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    repeats = args.repeats or (1 if gpu else 3)

    torch.manual_seed(0)
    model = build_model(preset, dtype=dtype, attn_implementation=args.attn, device=device).eval()
    if args.profile:
        profile_decode(model, device, prompt_len, image_side, args.profile)
        return
    results: dict[str, Any] = {
        "bench": "bench_hf_engine",
        "device": torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": preset,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": prompt_len,
        "image_side": image_side,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "runs": [],
    }
    warm = synthetic_requests(model.config, 2, prompt_len, image_side, seed=1)
    run_ours(model, warm, 4, device)
    if not args.skip_baseline:
        run_generate(model, warm, 4, device)

    for batch in batch_sizes:
        requests = synthetic_requests(model.config, batch, prompt_len, image_side, seed=batch)
        tokens = batch * new_tokens
        # Sides alternate within each repeat (best of each kept), so load that comes and goes
        # on a shared machine hits both alike. Per decode step: (time for N tokens - time for
        # 1 token, i.e. prefill and the first sample) / (N - 1).
        sides = (
            {"ours": run_ours}
            if args.skip_baseline
            else {"ours": run_ours, "generate": run_generate}
        )
        best: dict[str, list[float]] = {name: [float("inf")] * 2 for name in sides}
        for run in sides.values():  # warm-up at this batch size (allocator, kernels)
            run(model, requests, 2, device)
        for _ in range(repeats):
            for name, run in sides.items():
                if gpu:
                    torch.cuda.empty_cache()
                full = run(model, requests, new_tokens, device)
                first = run(model, requests, 1, device)
                best[name] = [min(best[name][0], full), min(best[name][1], first)]
        row: dict[str, Any] = {"batch": batch}
        for name, (full, first) in best.items():
            row.update(
                {
                    f"{name}_s": full,
                    f"{name}_tok_s": tokens / full,
                    f"{name}_prefill_s": first,
                    f"{name}_step_ms": step_ms(full, first, new_tokens),
                }
            )
        if "generate" in best:
            row["ratio"] = row["generate_s"] / row["ours_s"]
            row["step_ratio"] = row["generate_step_ms"] / row["ours_step_ms"]
        if gpu:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.empty_cache()
        results["runs"].append(row)
        line = (
            f"batch {batch:4d}: HF engine {row['ours_tok_s']:9.1f} tok/s"
            f" ({row['ours_step_ms']:7.1f} ms/step)"
        )
        if "ratio" in row:
            line += (
                f" | model.generate {row['generate_tok_s']:9.1f} tok/s"
                f" ({row['generate_step_ms']:7.1f} ms/step) | ratio {row['ratio']:.2f}x"
                f" (per step {row['step_ratio']:.2f}x)"
            )
        print(line, flush=True)

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
