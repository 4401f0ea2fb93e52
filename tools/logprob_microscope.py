"""The log-prob microscope: where the engine's and the trainers' log-probs part, and why.

One model folder (or a shape preset built into one, random weights) and one batch: Geometry3K
prompts as the GRPO loop builds them (or random text prompts, ``--text``), responses sampled by
the transformers engine with the kernels it uses on this machine. Then, per ``--dtypes`` entry,
the same response tokens go through every path:

* ``engine``: the rollout's own log-probs (CUDA graphs, decode kernels, as a GRPO step has them);
* ``decode``: the engine's prefill, then its decode step teacher-forced token by token (eager),
  recording each layer and each gated-delta-net intermediate; on CUDA also with SDPA decode
  attention (``decode-sdpa``) and dense MoE experts (``decode-dense-moe``);
* ``forward``: transformers' forward over prompt + response, one sample (the engine's prefill
  path), and on a machine with fla also through the torch reference delta rule
  (``forward-torch-gdn``); for MoE models also the decode replaying the forward's routing
  (``decode-replay``). The chunked delta rule runs on float32 inputs as every side now runs it
  (``vlm_models.linear_attention.use_float32_delta_rule``); ``--delta-rule inputs`` runs it in
  the model's dtype instead, as the engine and the trainers did before 2026-12-06;
* ``fsdp`` / ``megatron``: each trainer's ``compute_logprobs`` over the packed batch.

It prints, per dtype, the mean |gap| of every path against ``forward`` and against ``engine``,
the gap by response position, and decode against forward layer by layer (and inside each
gated-delta-net layer: conv output, recurrence output, gate, gated norm), naming the first
place the two part. The JSON (``--out``) holds all of it.

    # CPU: the Qwen3.5-35B-A3B geometry shrunk (hidden 256, 16 experts), 8 layers
    uv run python tools/logprob_microscope.py --shape qwen3.5-35b-a3b --layers 8 \\
        --override hidden_size=256 --override num_experts=16 --dtypes float32,bfloat16
    # GPU (tools/bench/gpu_suite.sh microscope): the cut at full width, bf16
    python3 tools/logprob_microscope.py --shape qwen3.5-35b-a3b --layers 8 --device cuda
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

logger = logging.getLogger("microscope")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def model_folder(args: argparse.Namespace) -> Path:
    """The folder given, or the shape preset built into ``--work-dir`` (random weights, the
    real Qwen3-VL processor, as ``bench_grpo_e2e.py`` builds it)."""
    if args.model:
        return Path(args.model)
    from bench_grpo_e2e import build_hf_folder
    from harness import shared_dir

    overrides = dict(item.split("=", 1) for item in args.override)
    overrides = {k: _value(v) for k, v in overrides.items()}
    name = f"micro_{args.shape}" + (f"_{args.layers}l" if args.layers else "")
    name += "".join(f"_{k}{v}" for k, v in sorted(overrides.items()))
    tokenizer = shared_dir() / "models" / "Qwen3-VL-4B-Instruct"
    out = Path(args.work_dir) / name
    return build_hf_folder(args.shape, tokenizer, out, args.seed, args.layers, overrides)


def requests_for(args: argparse.Namespace, folder: Path, config: Any) -> list[Any]:
    """``--prompts`` x ``--samples`` requests: Geometry3K validation rows through the loop's
    prompt builder (its "boxed" template), or random text prompts with ``--text``."""
    from rollout_sglang.types import GenerateRequest

    if args.text:
        gen = torch.Generator().manual_seed(args.seed)
        heads = [
            torch.randint(100, 5000, (int(n),), generator=gen)
            for n in torch.randint(16, 48, (args.prompts,), generator=gen)
        ]
        return [GenerateRequest(input_ids=h) for h in heads for _ in range(args.samples)]
    import pyarrow.parquet as pq
    from harness import shared_dir
    from transformers import AutoProcessor

    from vlm_data.prompts import PromptBuilder

    data = Path(args.data) if args.data else shared_dir() / "data" / "geo3k"
    parquet = data / "validation.parquet" if data.is_dir() else data
    rows = pq.read_table(parquet).to_pylist()
    try:
        processor = AutoProcessor.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"{folder}: no processor to build Geometry3K prompts with ({exc}); pass --text"
        ) from None
    if int(processor.image_token_id) != int(config.image_token_id):
        raise SystemExit(f"{folder}: the processor's image token is not the model's")
    prompts = list(PromptBuilder(processor, template="boxed").iter_samples(rows))[: args.prompts]
    return [GenerateRequest.from_prompt(p) for p in prompts for _ in range(args.samples)]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _torch_delta_rule(fn: Any) -> Any:
    """transformers' torch reference under its kernel-resolving wrappers."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _resolved(fn: Any) -> Any:
    """The implementation a transformers kernel-or-fallback wrapper calls (fla's on a GPU that
    has it, else the torch reference)."""
    seen = fn
    while seen is not None:
        try:
            found = inspect.getclosurevars(seen).nonlocals.get("implementation")
        except (TypeError, ValueError):
            found = None
        if found is not None:
            return found
        seen = getattr(seen, "__wrapped__", None)
    return fn


def _note(paths: dict[str, list[Any]], name: str) -> None:
    """Log a path's mean gap as soon as it is run, so a call cut short still tells it."""
    gaps = {
        ref: torch.cat(
            [(a.logprobs - b.logprobs).abs() for a, b in zip(paths[name], paths[ref], strict=True)]
        )
        .mean()
        .item()
        for ref in ("engine", "forward")
        if ref in paths and ref != name
    }
    logger.info("%s: %s", name, ", ".join(f"vs {k} {v:.3g}" for k, v in gaps.items()))


def engine_paths(
    folder: Path, dtype: torch.dtype, device: torch.device, args: argparse.Namespace
) -> tuple[list[Any], list[Any], dict[str, list[Any]], dict[str, Any]]:
    """Sample the responses, then run the engine's paths over them: (requests, completions,
    {path: traces}, the kernels each path ran) for the kept samples."""
    from rollout_sglang.hf import microscope as ms
    from rollout_sglang.hf.engine import ENGINE_MODEL_OPTIONS, HFEngine
    from rollout_sglang.types import SamplingParams
    from vlm_models.build import build_model
    from vlm_models.linear_attention import float32_inputs, use_float32_delta_rule

    model = build_model(str(folder), dtype=dtype, device=str(device), **ENGINE_MODEL_OPTIONS)
    use_float32_delta_rule(model, on=args.delta_rule == "float32")
    config = model.config
    requests = requests_for(args, folder, config)
    engine = HFEngine(model, device=device, max_batch_size=max(len(requests), 1))
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    completions = engine.generate(requests, params)
    logger.info("%s: generated in %.1f s", dtype, time.perf_counter() - start)
    placeholders = {getattr(config, k, None) for k in ("image_token_id", "video_token_id")}
    keep = [
        i
        for i, c in enumerate(completions)
        if c.ok and len(c.token_ids) >= 2 and not placeholders & set(c.token_ids)
    ]
    if len(keep) < len(completions):
        logger.info(
            "kept %d of %d samples (>= 2 tokens, no image placeholder)", len(keep), len(completions)
        )
    requests = [requests[i] for i in keep]
    completions = [completions[i] for i in keep]
    responses = [c.token_ids for c in completions]
    paths: dict[str, list[Any]] = {
        "engine": [ms.Trace(logprobs=torch.tensor(c.logprobs)) for c in completions]
    }
    decoder = engine.decoder
    kernels: dict[str, Any] = {
        "decode_attention": decoder.attention,
        "moe_grouped": decoder.moe_grouped,
        "cuda_graphs": engine.runner.use_graphs if engine.runner is not None else None,
    }
    variants = [("decode", {})]
    skip = set(args.skip.split(",")) if args.skip else set()
    if device.type == "cuda":
        if decoder.attention != "sdpa":
            variants.append(("decode-sdpa", {"attention": "sdpa"}))
        if decoder.moe_grouped:
            variants.append(("decode-dense-moe", {"moe_grouped": False}))
    for name, settings in variants:
        if name in skip:
            continue
        saved = {k: getattr(decoder, k) for k in settings}
        for k, v in settings.items():
            setattr(decoder, k, v)
        try:
            paths[name] = ms.decode_trace(engine, requests, responses)
            _note(paths, name)
        finally:
            for k, v in saved.items():
                setattr(decoder, k, v)
    paths["forward"] = [
        ms.forward_trace(engine, r, t) for r, t in zip(requests, responses, strict=True)
    ]
    _note(paths, "forward")
    if paths["forward"][0].experts:  # MoE: the decode with the forward's routing, no flips
        paths["decode-replay"] = ms.decode_trace(
            engine, requests, responses, replay=paths["forward"]
        )
        _note(paths, "decode-replay")
    layers = [getattr(layer, "linear_attn", None) for layer in model.model.language_model.layers]
    gdn = [a for a in layers if a is not None]
    if gdn:
        module = ms._transformers_module(gdn[0])
        kernel = module.torch_chunk_gated_delta_rule
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            impl = _resolved(getattr(module, name))
            kernels[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
        reference = float32_inputs(_torch_delta_rule(kernel))
        if (
            device.type == "cuda"
            and "fla" in kernels["torch_chunk_gated_delta_rule"]
            and "forward-torch-gdn" not in skip
        ):
            module.torch_chunk_gated_delta_rule = reference
            try:
                paths["forward-torch-gdn"] = [
                    ms.forward_trace(engine, r, t) for r, t in zip(requests, responses, strict=True)
                ]
            finally:
                module.torch_chunk_gated_delta_rule = kernel
            _note(paths, "forward-torch-gdn")
    logger.info("kernels: %s", kernels)
    engine.shutdown()
    del engine, model
    _free()
    return requests, completions, paths, kernels


def trainer_paths(
    folder: Path,
    dtype_name: str,
    device: torch.device,
    requests: list[Any],
    completions: list[Any],
    trainers: list[str],
) -> dict[str, list[Any]]:
    """Each trainer's log-probs of the same samples (its default settings on this device)."""
    from rl_runtime.rollout_batch import build_train_batch
    from rollout_sglang.hf.microscope import Trace

    batch = build_train_batch(requests, completions, torch.zeros(len(completions)))
    paths: dict[str, list[Any]] = {}
    for name in trainers:
        start = time.perf_counter()
        try:
            if name == "fsdp":
                from trainers_fsdp import FsdpConfig
                from trainers_fsdp.actor import FsdpActor

                actor: Any = FsdpActor(
                    FsdpConfig(model=str(folder), device=device.type, param_dtype=dtype_name)
                )
            elif name == "megatron":
                from trainers_megatron import MegatronConfig
                from trainers_megatron.actor import MegatronActor

                actor = MegatronActor(MegatronConfig(model=str(folder), param_dtype=dtype_name))
            else:
                raise SystemExit(f"unknown trainer {name!r}: fsdp or megatron")
        except ImportError as exc:
            logger.warning("%s trainer skipped: %s", name, exc)
            continue
        except torch.OutOfMemoryError as exc:  # a trainer's state beside the weights
            logger.warning("%s trainer skipped: %s", name, str(exc).splitlines()[0])
            _free()
            continue
        old = actor.compute_logprobs(batch)
        paths[name] = [
            Trace(logprobs=lp[m.bool()].float().cpu())
            for lp, m in zip(old, batch.loss_mask, strict=True)
        ]
        logger.info("%s: log-probs in %.1f s", name, time.perf_counter() - start)
        close = getattr(actor, "shutdown", None) or getattr(actor, "close", None)
        if close is not None:
            close()
        del actor
        _free()
    return paths


def report(paths: dict[str, list[Any]], part_at: float) -> dict[str, Any]:
    """Every path against ``forward`` and against ``engine``; decode's layers against forward."""
    from rollout_sglang.hf.microscope import compare

    out: dict[str, Any] = {"against_forward": {}, "against_engine": {}}
    for name, traces in paths.items():
        if name != "forward":
            out["against_forward"][name] = compare(traces, paths["forward"], part_at=part_at)
        if name != "engine":
            out["against_engine"][name] = {
                k: v
                for k, v in compare(traces, paths["engine"], part_at=part_at).items()
                if k not in ("layers", "parts_at")
            }
    for result in out["against_forward"].values():
        if not result["layers"]:
            result.pop("layers")
            result.pop("parts_at")
    return out


def print_report(dtype: str, result: dict[str, Any]) -> None:
    print(f"== {dtype}: mean |log-prob gap| per response token ({result['tokens']} tokens)")
    for name, r in result["against_forward"].items():
        eng = result["against_engine"].get(name, {}).get("mean_gap")
        vs_engine = "" if eng is None else f", vs engine {eng:.3g}"
        print(f"  {name:>18}: vs forward {r['mean_gap']:.3g} (max {r['max_gap']:.3g}){vs_engine}")
        print(
            f"  {'':>18}  by position: "
            + ", ".join(f"{k}: {v:.2g}" for k, v in r["gap_by_position"].items())
        )
    for pair, r in result.get("pairs", {}).items():
        print(f"  {pair}: {r['mean_gap']:.3g} (max {r['max_gap']:.3g})")
    for path in ("decode", "decode-replay"):
        decode = result["against_forward"].get(path, {})
        if not decode.get("layers"):
            continue
        print(f"  {path} vs forward, relative rms difference after each layer:")
        for row in decode["layers"]:
            print(
                f"    layer {row['layer']:2d}: "
                + ", ".join(f"{k} {v:.2e}" for k, v in row.items() if k != "layer")
            )
        where = decode["parts_at"]
        print(
            "  parts at: "
            + (
                "nowhere above the threshold"
                if where is None
                else f"layer {where['layer']} {where['what']} ({where['relative']:.2e})"
            )
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="an HF folder (else --shape builds one)")
    ap.add_argument("--shape", default="qwen3.5-35b-a3b", help="a shape preset (random init)")
    ap.add_argument("--layers", type=int, help="cut the shape to this many decoder layers")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key of the shape (hidden_size=256, num_experts=16)",
    )
    ap.add_argument("--work-dir", default="/tmp/microscope", help="where a shape's folder goes")
    ap.add_argument(
        "--dtypes", default=None, help="default: bfloat16 on CUDA, float32,bfloat16 on a CPU"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true", help="every response max-new-tokens long")
    ap.add_argument("--text", action="store_true", help="random text prompts, no images")
    ap.add_argument("--data", help="Geometry3K folder or parquet (default: GLIMPSE_SHARED's)")
    ap.add_argument("--trainers", default="fsdp,megatron")
    ap.add_argument(
        "--skip",
        default="",
        help="paths not to run (decode-sdpa,decode-dense-moe,forward-torch-gdn)",
    )
    ap.add_argument(
        "--part-at",
        type=float,
        default=None,
        help="relative difference that counts as parted (default: 1e-5 in float32, "
        "5e-2 in 16-bit dtypes)",
    )
    ap.add_argument(
        "--delta-rule",
        choices=("float32", "inputs"),
        default="float32",
        help="the engine side's chunked delta rule: on float32 inputs (what every side runs), "
        "or in the model's dtype (inputs: the engine and trainers before 2026-12-06)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    dtypes = args.dtypes or ("bfloat16" if cuda else "float32,bfloat16")
    folder = model_folder(args)
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip() not in ("", "none")]
    results: dict[str, Any] = {"model": str(folder), "device": str(device), "args": vars(args)}
    if cuda:
        results["gpu"] = torch.cuda.get_device_name()
    for name in dtypes.split(","):
        dtype = getattr(torch, name)
        part_at = args.part_at or (1e-5 if dtype == torch.float32 else 5e-2)
        torch.manual_seed(args.seed)
        requests, completions, paths, kernels = engine_paths(folder, dtype, device, args)
        for stage in ("engine", "trainers"):  # the engine's report stands if a trainer fails
            if stage == "trainers" and trainers:
                paths.update(trainer_paths(folder, name, device, requests, completions, trainers))
            elif stage == "trainers":
                break
            result = report(paths, part_at)
            result["tokens"] = sum(len(c.token_ids) for c in completions)
            result["samples"] = len(completions)
            result["kernels"] = kernels
            results[name] = result
            print_report(f"{name} ({stage})", result)
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
