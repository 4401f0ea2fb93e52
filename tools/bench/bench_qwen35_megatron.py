"""Qwen3.5-35B-A3B-shaped GRPO train steps on the Megatron actor: fla's gated-delta-net kernels
against the torch reference path, in one run on the same weights.

The model is ``qwen3.5-35b-a3b`` (vlm_models' shape preset) cut to ``--layers`` decoder layers
(the hybrid pattern kept: three gated-delta-net layers, then a gated full-attention one; every
layer MoE with all 256 experts and the shared expert; the whole vision tower), random init, on
one rank (TP1 EP1). The batch is geo3k-like and synthetic: ``--samples`` rows of one image
(``--image-size`` px) in a ``--prompt-len`` prompt and a ``--response-len`` response, packed
into micro-batches of ``--max-tokens-per-gpu`` tokens (each sample's recurrent state starts
fresh at its boundary).

One actor is built; the kernels are switched between runs (``PackedGatedDeltaNet.path``), so
both see the same weights and optimizer. In order:

1. log-probs with each path on the initial weights: max |fla - torch| over response tokens,
   and fla packed against one sample per micro-batch (the boundary reset on the GPU kernel);
2. per path, one warm-up step then ``--steps`` timed GRPO steps (forward, backward, AdamW):
   tokens/s and peak allocated memory; then fla with one sample per micro-batch (the slime
   recipe's micro-batch 1, which Glimpse only falls back to) for the packing speed-up.

Rank 0 prints the ratios and writes ``--out`` JSON. fla is needed for its path (the device
machine carries ``fla-core`` as a wheel, see gpu_suite.sh); without it only torch runs.

CPU check (tiny MoE preset, seconds):
    uv run python tools/bench/bench_qwen35_megatron.py --device cpu --tiny --out /tmp/q35.json
H200 (about 2 minutes):
    bash tools/bench/gpu_suite.sh qwen35
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
from harness import (
    fill_unset,
    peak_memory_gib,
    reset_peak_memory,
    sync,
    time_steps,
    write_json,
)

log = logging.getLogger("bench_qwen35_megatron")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="qwen3.5-moe-tiny (a CPU check)")
    p.add_argument("--dense", action="store_true", help="with --tiny: qwen3.5-tiny (no MoE)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept (>= 4: one full)")
    p.add_argument("--samples", type=int, default=None, help="rows per step (16 CUDA, 4 tiny)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (400 / 48)")
    p.add_argument("--response-len", type=int, default=None, help="response tokens (1024 / 16)")
    p.add_argument("--image-size", type=int, default=None, help="image px (448 / 64)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="(8192 / 256)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per path (3 / 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)"
    )
    p.add_argument("--out", type=Path, default=None, help="JSON result path")
    args = p.parse_args()
    big = not args.tiny
    fill_unset(
        args,
        samples=16 if big else 4,
        prompt_len=400 if big else 48,
        response_len=1024 if big else 16,
        image_size=448 if big else 64,
        max_tokens_per_gpu=8192 if big else 256,
        steps=3 if big else 1,
    )
    if args.layers < 4:
        p.error("--layers must be >= 4 (the fourth layer is the first full-attention one)")
    return args


def preset_name(args: argparse.Namespace) -> str:
    if not args.tiny:
        return "qwen3.5-35b-a3b"
    return "qwen3.5-tiny" if args.dense else "qwen3.5-moe-tiny"


def model_config(name: str, layers: int) -> Any:
    """The shape cut to ``layers`` decoder layers, its layer pattern kept."""
    from vlm_models.presets import preset_config

    config = preset_config(name)
    text = config.text_config
    pattern = list(text.layer_types)
    text.layer_types = (pattern * (layers // len(pattern) + 1))[:layers]
    text.num_hidden_layers = layers
    assert "full_attention" in text.layer_types and "linear_attention" in text.layer_types
    return config


def synthetic_batch(config: Any, args: argparse.Namespace) -> Any:
    """Rows of [prompt with one image | response], response-masked, advantages of either sign."""
    from rl_algos import TrainBatch

    vision = config.vision_config
    grid = args.image_size // vision.patch_size
    n_image = grid * grid // vision.spatial_merge_size**2
    if n_image + 8 > args.prompt_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} is too short for {n_image} image tokens")
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    vocab = min(config.text_config.vocab_size, 150_000)  # ordinary text ids, no special ones
    gen = torch.Generator().manual_seed(args.seed)
    fields: dict[str, list] = {
        k: [] for k in ("input_ids", "loss_mask", "advantages", "pixel_values", "image_grid_thw")
    }
    for i in range(args.samples):
        ids = torch.randint(0, vocab, (args.prompt_len + args.response_len,), generator=gen)
        ids[3] = config.vision_start_token_id
        ids[4 : 4 + n_image] = config.image_token_id
        ids[4 + n_image] = config.vision_end_token_id
        mask = torch.zeros(len(ids))
        mask[args.prompt_len :] = 1.0
        fields["input_ids"].append(ids)
        fields["loss_mask"].append(mask)
        fields["advantages"].append(mask * (1.0 if i % 2 == 0 else -1.0))
        fields["pixel_values"].append(torch.randn(grid * grid, patch_dim, generator=gen))
        fields["image_grid_thw"].append(torch.tensor([[1, grid, grid]]))
    return TrainBatch(**fields)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_path(module: torch.nn.Module, path: str) -> int:
    """Point every gated-delta-net layer at ``path``; the number of layers switched."""
    from vlm_models.megatron import PackedGatedDeltaNet

    layers = [m for m in module.modules() if isinstance(m, PackedGatedDeltaNet)]
    for m in layers:
        m.path = path
    return len(layers)


def timed_steps(actor: Any, batch: Any, steps: int, device: str) -> dict[str, float]:
    """One warm-up GRPO step, then ``steps`` timed: tokens/s, seconds per step, peak memory."""
    tokens = sum(batch.lengths)
    actor.train_step(batch, loss="grpo")
    sync(device)
    reset_peak_memory(device)
    metrics: dict[str, float] = {}

    def step() -> None:
        metrics.update(actor.train_step(batch, loss="grpo"))

    seconds = time_steps(step, device, steps=steps).mean
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": seconds,
        "peak_memory_gib": peak_memory_gib(device),
        "num_micro_batches": metrics.get("num_micro_batches"),
        "grad_norm": metrics.get("grad_norm"),
    }


def _diffs(
    a: list[torch.Tensor], b: list[torch.Tensor], masks: list[torch.Tensor]
) -> dict[str, float]:
    """|a - b| over the loss tokens: max, mean, and the share above 0.1. In bf16 the max over
    thousands of tokens is a poor check on its own: one token whose router picks another
    expert moves its log-prob by far more than rounding does."""
    gaps = torch.cat([(x - y).abs()[m.bool()] for x, y, m in zip(a, b, masks, strict=True)])
    return {
        "max": float(gaps.max()),
        "mean": float(gaps.mean()),
        "frac_above_0.1": float((gaps > 0.1).float().mean()),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible (use --device cpu --tiny)")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the actor picks CUDA wherever it sees one
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from rl_algos.optimizer import OptimConfig
    from trainers_megatron import MegatronConfig
    from trainers_megatron.actor import MegatronActor
    from vlm_models.megatron import fla_available
    from vlm_models.megatron.gated_delta_net import fla_refusal

    config = model_config(preset_name(args), args.layers)
    batch = synthetic_batch(config, args)
    start = time.perf_counter()
    actor = MegatronActor(
        MegatronConfig(
            model=config,
            seed=args.seed,
            optim=OptimConfig(lr=1e-6),
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            linear_attention_kernels="torch",  # switched per run below
            param_dtype=args.dtype,
        )
    )
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in actor.module.parameters())
    refusal = fla_refusal(torch.device(args.device)) if fla_available() else "fla not installed"
    paths = ["torch"] if refusal else ["fla", "torch"]
    if refusal:
        log.warning("fla path not measured: %s", refusal)
    log.info("built %.2fB parameters in %.0f s; paths %s", params / 1e9, build_s, paths)

    masks = batch.loss_mask
    logprobs = {}
    for path in paths:
        set_path(actor.module, path)
        logprobs[path] = actor.compute_logprobs(batch)
    batch.old_logprobs = logprobs[paths[0]]  # GRPO's ratio starts at 1
    result: dict[str, Any] = dict(
        shape=preset_name(args),
        layers=list(config.text_config.layer_types),
        num_experts=getattr(config.text_config, "num_experts", 0),
        parameters=params,
        device=args.device,
        dtype=str(actor.dtype).removeprefix("torch."),
        samples=args.samples,
        tokens_per_step=sum(batch.lengths),
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        build_s=build_s,
        fla_available=fla_available(),
        fla_refusal=refusal,
    )
    if "fla" in paths:
        gaps = _diffs(logprobs["fla"], logprobs["torch"], masks)
        result["logprob_max_diff_fla_vs_torch"] = gaps["max"]
        result["logprob_diffs_fla_vs_torch"] = gaps
    # packed against one sample per micro-batch, on each path (a gap on one only is its kernel's)
    actor.config.max_tokens_per_gpu = 1
    for path in paths:
        set_path(actor.module, path)
        gaps = _diffs(logprobs[path], actor.compute_logprobs(batch), masks)
        result[f"logprob_diffs_packed_vs_alone_{path}"] = gaps
    actor.config.max_tokens_per_gpu = args.max_tokens_per_gpu
    gaps = result[f"logprob_diffs_packed_vs_alone_{paths[0]}"]
    result[f"logprob_max_diff_packed_vs_alone_{paths[0]}"] = gaps["max"]  # earlier runs' key

    runs: dict[str, dict[str, float]] = {}
    for path in list(paths):
        set_path(actor.module, path)
        try:
            runs[path] = timed_steps(actor, batch, args.steps, args.device)
        except Exception as exc:  # a kernel path that fails (fla's backward) still leaves torch's
            log.exception("%s path failed in training", path)
            result[f"{path}_train_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            paths.remove(path)
            continue
        log.info("%s: %s", path, runs[path])
    if not paths:
        raise SystemExit(f"every path failed: {result}")
    set_path(actor.module, paths[0])
    actor.config.max_tokens_per_gpu = 1  # one sample per micro-batch: the recipe's rule
    runs[f"{paths[0]}_one_sample_per_micro_batch"] = timed_steps(
        actor, batch, args.steps, args.device
    )
    actor.config.max_tokens_per_gpu = args.max_tokens_per_gpu
    result["runs"] = runs
    first = runs[paths[0]]
    one = runs[f"{paths[0]}_one_sample_per_micro_batch"]
    result["packed_over_one_sample_tokens_per_s"] = first["tokens_per_s"] / one["tokens_per_s"]
    if "fla" in paths:
        result["fla_over_torch_tokens_per_s"] = (
            first["tokens_per_s"] / runs["torch"]["tokens_per_s"]
        )

    lines = [f"{result['shape']} x{args.layers} layers, {params / 1e9:.2f}B params, {args.device}"]
    for name, r in runs.items():
        peak = "" if r["peak_memory_gib"] is None else f", peak {r['peak_memory_gib']:.1f} GiB"
        lines.append(f"  {name}: {r['tokens_per_s']:.0f} tokens/s ({r['step_s']:.2f} s/step{peak})")
    lines += [f"  {k}: {v}" for k, v in result.items() if k.endswith("_train_error")]
    lines.append(
        f"  packed / one sample per micro-batch: {result['packed_over_one_sample_tokens_per_s']:.2f}x"
    )
    if "fla" in paths:
        lines.append(
            f"  fla / torch: {result['fla_over_torch_tokens_per_s']:.2f}x tokens/s; "
            f"log-prob max |fla - torch| {result['logprob_max_diff_fla_vs_torch']:.2e}"
        )
    for key, gaps in result.items():
        if key.startswith("logprob_diffs_"):
            lines.append(
                f"  {key.removeprefix('logprob_diffs_')}: |dlogp| max {gaps['max']:.2e}, "
                f"mean {gaps['mean']:.2e}, {100 * gaps['frac_above_0.1']:.2f} % above 0.1"
            )
    print("\n".join(lines))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
