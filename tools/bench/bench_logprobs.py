"""Peak memory and time of rl_algos.logprobs_from_logits vs plain log_softmax + gather.

Forward + backward on bf16 logits [tokens, vocab] (what a trainer hands over), baseline and ours
in the same run, printing the ratio. Default size is the issue's 8,192 tokens x 151,936 vocab
(Qwen3-VL); use --tokens for a small CPU check.

Memory: on CUDA, torch.cuda.max_memory_allocated above what was allocated before the call. On
CPU, each implementation runs in a fresh subprocess and the figure is peak RSS (ru_maxrss) above
the RSS after the inputs were created, so one run cannot inherit the other's peak.

    uv run python tools/bench/bench_logprobs.py --device cpu --tokens 512 --out /tmp/lp.json
    PYTHONPATH=packages/rl-algos/src python tools/bench/bench_logprobs.py --device cuda --out r.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from harness import (
    device_name,
    emit,
    in_fresh_process,
    reset_peak_memory,
    sync,
    time_calls,
    workspace_paths,
    write_json,
)

sys.path.extend(workspace_paths())  # a checkout without the workspace installed
from rl_algos import logprobs_from_logits


def baseline_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What most trainers write: a float32 log_softmax over the whole tensor, then gather."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)


def make_inputs(tokens: int, vocab: int, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    # Drawn directly in bf16 so no float32 [T, V] temporary inflates the CPU peak before we start.
    logits = torch.randn(tokens, vocab, generator=gen, device=device, dtype=torch.bfloat16)
    logits.mul_(3.0).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    weights = torch.randn(tokens, generator=gen, device=device)
    return logits, labels, weights


def run_once(impl: str, logits, labels, weights, args) -> None:
    if impl == "ours":
        out = logprobs_from_logits(
            logits, labels, chunk_size=args.chunk_size, compiled=args.compiled
        )
    else:
        out = baseline_logprobs(logits, labels)
    (out * weights).sum().backward()
    logits.grad = None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(impl: str, args) -> dict:
    """Peak extra memory and mean time of `impl` in this process."""
    # Pay one-time start-up costs (thread pools, kernels) on a tiny input, outside the figures.
    run_once(impl, *make_inputs(4, 64, args.device), args)
    logits, labels, weights = make_inputs(args.tokens, args.vocab, args.device)
    for _ in range(args.warmup):
        run_once(impl, logits, labels, weights, args)
    sync(args.device)
    reset_peak_memory(args.device)
    base = torch.cuda.memory_allocated() if args.device == "cuda" else _rss_bytes()
    timing = time_calls(
        lambda: run_once(impl, logits, labels, weights, args), args.device, repeats=args.repeats
    )
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"impl": impl, "peak_extra_bytes": max(int(peak), 0), "time_s": timing.mean}


def parity_check(args) -> float:
    """Max |ours - baseline| on the first rows, so the figures compare equal results."""
    logits, labels, _ = make_inputs(min(args.tokens, 256), args.vocab, args.device)
    with torch.no_grad():
        ours = logprobs_from_logits(
            logits, labels, chunk_size=args.chunk_size, compiled=args.compiled
        )
        ref = baseline_logprobs(logits, labels)
    return float((ours - ref).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: auto)")
    p.add_argument(
        "--compiled", action="store_true", help="ours: torch.compile-d chunk kernels (CUDA)"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed runs (cpu 1, cuda 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (cpu 0, cuda 2)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--worker", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.device == "cuda" else 1
    if args.warmup is None:
        args.warmup = 2 if args.device == "cuda" else 0

    if args.worker:  # one measurement in a fresh process (CPU peak RSS)
        emit(measure(args.worker, args))
        return

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but torch.cuda.is_available() is False")
    max_diff = parity_check(args)
    if args.device == "cpu":
        results = {
            impl: in_fresh_process(__file__, [*sys.argv[1:], "--worker", impl])
            for impl in ("baseline", "ours")
        }
    else:
        results = {impl: measure(impl, args) for impl in ("baseline", "ours")}
        torch.cuda.empty_cache()

    base, ours = results["baseline"], results["ours"]
    # Below 1 MiB the CPU figure is RSS noise (page granularity, allocator caching): no ratio.
    mib = 1 << 20
    mem_ratio = (
        base["peak_extra_bytes"] / ours["peak_extra_bytes"]
        if ours["peak_extra_bytes"] >= mib
        else float("nan")
    )
    time_ratio = base["time_s"] / ours["time_s"]
    gib = 1 << 30
    print(
        f"logprobs fwd+bwd, {args.tokens} tokens x {args.vocab} vocab, bf16 logits, {args.device}"
    )
    print(f"  parity: max |ours - baseline| = {max_diff:.2e}")
    print(f"  {'impl':<9} {'peak extra GiB':>15} {'time s':>9}")
    for name, r in (("baseline", base), ("ours", ours)):
        print(f"  {name:<9} {r['peak_extra_bytes'] / gib:>15.2f} {r['time_s']:>9.3f}")
    print(
        f"  memory ratio baseline/ours: {mem_ratio:.2f}x   time ratio baseline/ours: {time_ratio:.2f}x"
    )

    if args.out:
        record = {
            "bench": "logprobs_from_logits",
            "device": args.device,
            "device_name": device_name(args.device),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "tokens": args.tokens,
            "vocab": args.vocab,
            "chunk_size": args.chunk_size,
            "compiled": args.compiled,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "parity_max_abs_diff": max_diff,
            "baseline": base,
            "ours": ours,
            "memory_ratio": None if math.isnan(mem_ratio) else mem_ratio,
            "time_ratio": time_ratio,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        write_json(args.out, record)


if __name__ == "__main__":
    main()
