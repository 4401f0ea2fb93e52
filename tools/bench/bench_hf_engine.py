"""HF rollout engine vs plain ``model.generate``: decode throughput and log-prob fidelity.

A Qwen3-VL-shaped model with random weights (no download), synthetic prompts of
``--prompt-len`` tokens that each include one image (random pixels, a real Qwen3-VL vision
grid), ``--new-tokens`` sampled tokens per prompt with EOS ignored so every row runs to the
end. Both sides sample at temperature 1 with no top-k/top-p; ours also returns the log-prob of
every token, and for ``--check`` of its completions per batch the bench recomputes them with a
teacher-forced forward of prompt + response and reports the largest absolute difference.
Each ``--variants`` entry is one engine setting (CUDA graphs on/off, torch.compile, decode
attention, ``legacy``: the transformers loop), built once and reused, so captured graphs are not
re-captured per run. Prints tokens/s, ms per decode step and the ratios; ``--out`` writes the
figures as JSON.

A ratio to ``model.generate`` (host-bound, it moves 3x from day to day) flatters, so each side
is also put against the physical limits (`roofline`): the HBM bandwidth measured in the same
run (a 4 GiB device copy), the bytes a decode step must move (the language model's weights, of
an MoE layer only the experts the batch's routing is expected to hit, the live KV cache,
Qwen3.5's per-slot states) over its time per step (the engine's device time where it has one,
else wall), as GB/s and a fraction of that bandwidth; and the prefill's FLOPs over its time as
a fraction of ``--peak-tflops`` (MFU). On CPU the fractions read ``n/a``.

Runs with only ``packages/*/src`` on PYTHONPATH (torch, transformers; no datasets):

    # GPU (H200): Qwen3-VL-2B shapes, batch 64 and 256, 400-token prompts, 256 new tokens
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_hf_engine.py \
        --device cuda --variants graph,graph-matmul,graph-compile --out bench_hf_engine.json
    # H200: decode attention, SDPA over the KV bucket vs the Triton split-KV kernel, at ~650
    # live tokens a slot (520-token prompts + 256 new); the kernel alone: bench_decode_attention
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_hf_engine.py \
        --device cuda --batch-sizes 128,256 --prompt-len 520 --variants graph-sdpa,graph-triton \
        --skip-baseline --out bench_hf_attention.json
    # H200: the Qwen3.5-35B-A3B shape cut to 8 layers; decode step, legacy loop, generate
    python tools/bench/bench_hf_engine.py --device cuda --preset qwen3.5-35b-a3b --layers 8 \
        --batch-sizes 16,64,256 --variants graph,legacy --out bench_qwen35_moe.json
    # CPU smoke run (tiny model, small shapes)
    uv run python tools/bench/bench_hf_engine.py --device cpu
    uv run python tools/bench/bench_hf_engine.py --device cpu --preset qwen3.5-moe-tiny \
        --batch-sizes 2,4 --new-tokens 8 --repeats 1 --variants eager,legacy
    # the rollout as the GRPO loop sends it: Geometry3K prompts (real images, the real
    # processor, the "boxed" template), 16 prompts x 8 samples, 384 tokens, a seed per request
    python tools/bench/bench_hf_engine.py --device cuda --geo3k $GLIMPSE_SHARED/data/geo3k \
        --batch-sizes 128 --new-tokens 384 --skip-baseline

``--geo3k`` prompts differ in length, which ``model.generate`` cannot batch without padding, so
that mode times the engine alone and prints its own account (wall and device time of the
decode steps).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from harness import (
    PEAK_BF16_FLOPS,
    describe,
    peak_memory_gib,
    reset_peak_memory,
    roofline,
    shared_dir,
    timed,
    write_json,
)
from roofline import decode_step_bytes, format_table, mean_live_tokens, prefill_flops

from rollout_sglang.hf.engine import ENGINE_MODEL_OPTIONS, HFEngine
from rollout_sglang.types import GenerateRequest, SamplingParams
from vlm_models.build import build_model
from vlm_models.presets import apply_overrides, preset_config

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


def geo3k_requests(
    path: str, processor_dir: str, n: int, samples: int, config: Any
) -> list[GenerateRequest]:
    """``n`` requests as the GRPO loop builds them: ``n // samples`` Geometry3K validation rows
    through `vlm_data.PromptBuilder` (the launcher's "boxed" template), each repeated
    ``samples`` times (one GRPO group), with no fixed seed (the engine gives each its own)."""
    import pyarrow.parquet as pq
    from transformers import AutoProcessor

    from vlm_data.prompts import PromptBuilder

    parquet = Path(path) / "validation.parquet" if Path(path).is_dir() else Path(path)
    rows = pq.read_table(parquet).to_pylist()  # lists as lists (pandas gives arrays)
    processor = AutoProcessor.from_pretrained(processor_dir)
    if int(processor.image_token_id) != int(config.image_token_id):
        raise ValueError(f"{processor_dir}: its image token is not the model's")
    builder = PromptBuilder(processor, template="boxed")
    prompts = list(builder.iter_samples(rows))[: max(n // samples, 1)]
    requests = [
        GenerateRequest.from_prompt(p, request_id=f"{p.index}/{k}")
        for p in prompts
        for k in range(samples)
    ]
    lengths = [r.prompt_length for r in requests]
    logger.info(
        "geo3k: %d prompts x %d samples, prompt tokens %d-%d (mean %.0f)",
        len(prompts),
        samples,
        min(lengths),
        max(lengths),
        sum(lengths) / len(lengths),
    )
    return requests[:n]


# Engine settings a run can compare (--variants), on top of the engine's defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"cuda_graphs": False},
    "graph": {},  # decode attention "auto": the Triton split-KV kernel on CUDA
    "graph-triton": {"decode_attention": "triton"},
    "graph-sdpa": {"decode_attention": "sdpa"},
    "graph-matmul": {"decode_attention": "matmul"},
    "graph-compile": {"compile": True},
    "graph-compile-matmul": {"compile": True, "decode_attention": "matmul"},
    "legacy": {"legacy_decode": True},  # the transformers loop: the engine's old decode
}


def processor_dir(args: argparse.Namespace) -> Path:
    return Path(args.processor or shared_dir() / "models" / "Qwen3-VL-4B-Instruct")


def bench_config(args: argparse.Namespace, preset: str) -> Any:
    """The preset's config, cut to ``--layers`` (Qwen3.5 keeps its layer pattern), with the
    image placeholder ids of the processor where one is found (a Qwen3.5 shape numbers them
    otherwise; ``--geo3k`` needs them to agree), as ``bench_grpo_e2e`` builds its folders."""
    config = preset_config(preset, **({"num_hidden_layers": args.layers} if args.layers else {}))
    folder = processor_dir(args)
    if not (folder / "preprocessor_config.json").is_file():
        if args.geo3k:
            raise SystemExit(f"--geo3k needs a processor: none at {folder}")
        logger.info("no processor at %s: the preset's image token ids stay", folder)
        return config
    from vlm_data.processor import build_processor
    from vlm_data.tokens import model_token_ids

    ids = model_token_ids(build_processor(str(folder)))
    vision = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return apply_overrides(config, {k: ids[k] for k in vision})


def limits(
    model: Any,
    requests: list[GenerateRequest],
    new_tokens: int,
    dtype: torch.dtype,
) -> tuple[dict[str, float], float]:
    """(bytes a decode step of these requests must move, split; FLOPs of their prefill)."""
    lengths = [r.prompt_length for r in requests]
    live = mean_live_tokens(lengths, new_tokens)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    step = decode_step_bytes(model.config, len(requests), live, dtype_bytes)
    grids = [g for r in requests if r.image_grid_thw is not None for g in r.image_grid_thw.tolist()]
    return step, prefill_flops(model.config, lengths, grids)


def run_ours(engine: HFEngine, requests, new_tokens: int, device) -> tuple[float, list]:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    elapsed, out = timed(lambda: engine.generate(requests, params), device)
    bad = [c.error for c in out if not c.ok or c.response_length != new_tokens]
    if bad:
        raise RuntimeError(f"HF engine: {len(bad)} incomplete completions, e.g. {bad[0]}")
    return elapsed, out


@torch.inference_mode()
def logprob_gap(model, requests, completions, device, count: int) -> float:
    """Largest |engine log-prob - teacher-forced log-prob| over the first ``count`` completions:
    a plain forward of prompt + response, the model computing its own M-RoPE positions."""
    gap = 0.0
    for request, completion in list(zip(requests, completions, strict=True))[:count]:
        response = torch.tensor(completion.token_ids)
        ids = torch.cat([request.input_ids, response])[None].to(device)
        types = torch.cat([request.mm_token_type_ids, torch.zeros_like(response)])[None]
        logits = model(
            input_ids=ids,
            pixel_values=request.pixel_values.to(device),
            image_grid_thw=request.image_grid_thw.to(device),
            mm_token_type_ids=types.to(device),
        ).logits[0]
        start = request.prompt_length - 1
        scores = logits[start : start + len(response)].float().log_softmax(-1)
        expected = scores.gather(-1, response.to(device)[:, None]).squeeze(-1).cpu()
        gap = max(gap, float((expected - torch.tensor(completion.logprobs)).abs().max()))
    return gap


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
    sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    # min_new_tokens: no early EOS, as ignore_eos on our side
    elapsed, out = timed(
        lambda: model.generate(
            **inputs, **sample, max_new_tokens=new_tokens, min_new_tokens=new_tokens
        ),
        device,
    )
    if out.shape[1] != requests[0].prompt_length + new_tokens:
        raise RuntimeError(f"model.generate returned {tuple(out.shape)}")
    return elapsed


def step_ms(total_s: float, first_token_s: float, new_tokens: int) -> float:
    """Milliseconds per decode step: the time beyond the first token, over the other tokens."""
    return (total_s - first_token_s) / max(new_tokens - 1, 1) * 1e3


def profile_decode(model, device, requests: list[GenerateRequest], path: str) -> None:
    """Top device/host ops of 32 decode steps over ``requests``, ours and (prompts of one
    length) model.generate, to see where a per-step gap comes from (slow under the profiler:
    give it minutes on a 2B model)."""
    from torch.profiler import ProfilerActivity, profile

    batch = len(requests)
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    out = []
    engine = HFEngine(model, device=device, max_batch_size=batch)
    sides = [("ours", lambda: run_ours(engine, requests, 32, device)[0])]
    if len({r.prompt_length for r in requests}) == 1:
        sides.append(("generate", lambda: run_generate(model, requests, 32, device)))
    for name, fn in sides:
        fn()  # warm
        with profile(activities=acts) as prof:
            elapsed = fn()
        out.append(f"===== {name}: {elapsed:.3f} s for 32 new tokens at batch {batch}")
        if name == "ours":
            out.append(f"engine account: {engine.last_stats}")
        for key in ("self_cuda_time_total", "cpu_time_total"):
            out.append(
                prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
            )
    with open(path, "w") as f:
        f.write("\n".join(out))


def side_roofline(
    ours: dict[str, Any],
    step_bytes: float,
    bandwidth: float | None,
    flops: float,
    peak_tflops: float | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An engine side's roofline and table entry. The step time is the engine's device time
    per decode step where it has one (CUDA), else its wall time per step (its own account,
    else the bench's); the prefill time is the engine's prefill calls (each ends reading the
    device), else the one-token run's wall time (the legacy loop keeps no account)."""
    st = ours["engine_stats"]
    steps = st.get("decode_steps") or 0
    device_ms = 1e3 * st["decode_device_s"] / steps if steps and st["decode_device_s"] else None
    wall_ms = 1e3 * st["decode_s"] / steps if steps else ours["step_ms"]
    step_s = (device_ms or wall_ms) / 1e3
    prefill_s = st.get("prefill_s") or ours["prefill_s"]
    roof = roofline(step_bytes, step_s, bandwidth, flops, prefill_s, peak_tflops)
    entry = {"step_ms": ours["step_ms"], "device_ms": device_ms}
    return roof, entry | {"time": "device" if device_ms else "wall", "roof": roof}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset",
        default=None,
        help="vlm_models preset (default: qwen3-vl-2b on cuda, qwen3-vl-tiny on cpu), e.g. "
        "qwen3-vl-30b-a3b, qwen3.5-35b-a3b, qwen3.5-moe-tiny",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="cut the preset to N decoder layers"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"peak TFLOP/s for the prefill MFU (default {PEAK_BF16_FLOPS / 1e12:g} on cuda: "
        "H100 / H200 bf16 dense; none on cpu)",
    )
    parser.add_argument(
        "--bandwidth-gib", type=float, default=4.0, help="buffer of the HBM bandwidth copy"
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
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma list of engine settings, from {', '.join(VARIANTS)} "
        "(default: graph on cuda, eager on cpu)",
    )
    parser.add_argument(
        "--check", type=int, default=4, help="completions per batch checked by a forward pass"
    )
    parser.add_argument("--kv-block", type=int, default=None, help="engine KV bucket (128)")
    parser.add_argument(
        "--prefill-tokens", type=int, default=16384, help="engine prompt tokens per prefill"
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--profile", default=None, help="profile 32 decode steps, tables here")
    parser.add_argument(
        "--geo3k",
        default=None,
        help="Geometry3K folder or parquet: its validation prompts instead of synthetic ones "
        "(engine only: the prompts differ in length)",
    )
    parser.add_argument(
        "--processor",
        default=None,
        help="processor folder for --geo3k (default: $GLIMPSE_SHARED/models/Qwen3-VL-4B-Instruct)",
    )
    parser.add_argument("--samples", type=int, default=8, help="--geo3k: samples per prompt")
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
    variants = (args.variants or ("graph" if gpu else "eager")).split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}: {', '.join(VARIANTS)}")

    # before the model: the bandwidth copy's buffers need twice --bandwidth-gib free
    chip = describe(device, hbm_gib=args.bandwidth_gib)
    print(chip, flush=True)
    bandwidth = chip.hbm_gb_s
    peak_tflops = args.peak_tflops or (chip.peak_flops and chip.peak_flops / 1e12)

    torch.manual_seed(0)
    config = bench_config(args, preset)
    model = build_model(
        config, dtype=dtype, attn_implementation=args.attn, device=device, **ENGINE_MODEL_OPTIONS
    ).eval()

    def requests_for(batch: int) -> list[GenerateRequest]:
        if args.geo3k:
            folder = str(processor_dir(args))
            return geo3k_requests(args.geo3k, folder, batch, args.samples, model.config)
        return synthetic_requests(model.config, batch, prompt_len, image_side, seed=batch)

    if args.profile:
        profile_decode(model, device, requests_for(batch_sizes[0]), args.profile)
        return
    results: dict[str, Any] = {
        "bench": "bench_hf_engine",
        "device": chip.name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": preset,
        "layers": args.layers,
        "hbm_gb_s": bandwidth,
        "peak_tflops": peak_tflops,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": prompt_len,
        "image_side": image_side,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "kv_block": args.kv_block,
        "prefill_tokens": args.prefill_tokens,
        "runs": [],
    }
    results["variants"] = variants
    for batch in batch_sizes:
        requests = requests_for(batch)
        tokens = len(requests) * new_tokens
        step_bytes, flops = limits(model, requests, new_tokens, dtype)
        row: dict[str, Any] = {"batch": batch, "step_bytes": step_bytes, "prefill_flops": flops}
        table: list[dict[str, Any]] = []
        # Per decode step: (time for N tokens - time for 1 token, i.e. prefill and the first
        # sample) / (N - 1). Best of --repeats for each.
        if not args.skip_baseline and not args.geo3k:
            run_generate(model, requests, 2, device)  # warm-up at this batch size
            full = first = float("inf")
            for _ in range(repeats):
                full = min(full, run_generate(model, requests, new_tokens, device))
                first = min(first, run_generate(model, requests, 1, device))
            row["generate"] = {
                "s": full,
                "tok_s": tokens / full,
                "prefill_s": first,
                "step_ms": step_ms(full, first, new_tokens),
            }
            g = row["generate"]  # host-bound: wall per step, prefill as the first token's run
            g["roofline"] = roofline(
                step_bytes["total"], g["step_ms"] / 1e3, bandwidth, flops, first, peak_tflops
            )
            table.append(
                {"side": "model.generate", "step_ms": g["step_ms"], "device_ms": None}
                | {"time": "wall", "roof": g["roofline"]}
            )
            if gpu:
                torch.cuda.empty_cache()
        for variant in variants:
            engine = None
            try:
                engine = HFEngine(
                    model,
                    device=device,
                    max_batch_size=batch,
                    kv_block=args.kv_block,
                    prefill_tokens=args.prefill_tokens,
                    **VARIANTS[variant],
                )
                # warm-up: the same run, so every graph the timed runs need is captured
                run_ours(engine, requests, new_tokens, device)
                full = first = float("inf")
                completions: list = []
                stats: dict[str, float] = {}
                for _ in range(repeats):
                    elapsed, out = run_ours(engine, requests, new_tokens, device)
                    if elapsed < full:
                        full, completions, stats = elapsed, out, dict(engine.last_stats)
                    first = min(first, run_ours(engine, requests, 1, device)[0])
                ours: dict[str, Any] = {
                    "s": full,
                    "tok_s": tokens / full,
                    "prefill_s": first,
                    "step_ms": step_ms(full, first, new_tokens),
                    "engine_stats": stats,
                    "graphs": engine.runner.num_graphs if engine.runner else 0,
                    "slots": engine.cache.slots if engine.cache else 0,
                    "max_abs_logprob_diff": logprob_gap(
                        model, requests, completions, device, args.check
                    ),
                }
                if "generate" in row:
                    ours["ratio"] = row["generate"]["s"] / full
                    ours["step_ratio"] = row["generate"]["step_ms"] / ours["step_ms"]
                ours["roofline"], entry = side_roofline(
                    ours, step_bytes["total"], bandwidth, flops, peak_tflops
                )
                table.append({"side": variant, **entry})
            except Exception as exc:  # one failing setting still reports the others
                logger.exception("variant %s at batch %d failed", variant, batch)
                ours = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if engine is not None:
                    engine.shutdown()
                if gpu:
                    torch.cuda.empty_cache()
            row[variant] = ours
        if gpu:
            row["peak_mem_gib"] = peak_memory_gib(device)
            reset_peak_memory(device)
        results["runs"].append(row)
        if "generate" in row:
            g = row["generate"]
            print(
                f"batch {batch:4d} model.generate: {g['tok_s']:9.1f} tok/s"
                f" ({g['step_ms']:6.2f} ms/step)",
                flush=True,
            )
        for variant in variants:
            r = row[variant]
            if "error" in r:
                print(f"batch {batch:4d} {variant}: FAILED {r['error']}", flush=True)
                continue
            line = (
                f"batch {batch:4d} {variant}: {r['tok_s']:9.1f} tok/s ({r['step_ms']:6.2f}"
                f" ms/step, prefill {r['prefill_s']:.2f} s, {r['graphs']} graphs)"
                f" max|dlogp| {r['max_abs_logprob_diff']:.3g}"
            )
            if "ratio" in r:
                line += f" | vs generate {r['ratio']:.2f}x, per step {r['step_ratio']:.2f}x"
            print(line, flush=True)
            st = r["engine_stats"]
            if st.get("decode_steps"):
                steps = st["decode_steps"]
                print(
                    f"    engine: {steps} decode steps, {1e3 * st['decode_s'] / steps:.2f} ms"
                    f" a step wall, {1e3 * st.get('decode_device_s', 0) / steps:.2f} ms device;"
                    f" {st['prefills']} prefills {st['prefill_s']:.2f} s",
                    flush=True,
                )
        print(
            f"batch {batch:4d} limits: a decode step must move {step_bytes['total'] / 1e9:.4g} GB"
            f" (weights {step_bytes['weights'] / 1e9:.4g}, KV {step_bytes['kv'] / 1e9:.4g},"
            f" states {step_bytes['states'] / 1e9:.4g}); prefill {flops / 1e12:.4g} TFLOP",
            flush=True,
        )
        print(format_table([{"batch": batch, **t} for t in table]), flush=True)

    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
