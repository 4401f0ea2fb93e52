"""A guard against slow paths, on a CPU: one GRPO step of the tiny Qwen3.5 preset beside the
tiny dense Qwen3-VL preset, phase by phase (issue 49).

Both tiny presets have the same widths and the same number of decoder layers; Qwen3.5 swaps
three layers in four for gated delta nets. At the same token counts (same prompts, batch and
response length; random weights rarely end a response early, and the table says the mean
length) each phase of a Qwen3.5 step should cost about what the dense one does. A Python loop
per token, a fallback that re-runs a prefill per sample, a recompile per shape shows up here as a
phase many times slower, without a GPU. Each model runs ``apps/geo3k_grpo`` in a process of its
own (``bench_grpo_e2e.run_backend``: the launcher as a user runs it), the two alternating, for
``--repeats`` rounds; a run's figure is the median of its steps after the first (the first
compiles and warms up). The table gives each model's median over rounds and the median of the
rounds' ratios (each round's two runs are neighbours in time: on a shared machine the load moves
both). The weight push scales with the model's bytes, not its tokens (Qwen3.5's untied 248k
vocabulary makes it 3x the dense preset's), so it is compared per GB pushed. Every ratio past
``--limit`` (3x) names its phase.

    GLIMPSE_SHARED=/work/shared uv run python tools/bench/bench_tiny_families.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_grpo_e2e import build_hf_folder, model_params, run_backend
from harness import shared_dir, write_json

SLOW, DENSE = "qwen3.5-tiny", "qwen3-vl-tiny"
#: the step's phases (`rl_runtime.loop`), then the engine's split of the rollout
PHASES = ("rollout", "reward", "logprobs", "train", "sync", "step")
ENGINE = ("rollout_engine_prefill", "rollout_engine_decode")


SYNC_PER_GB = "sync_push per GB"


def phase_times(result: dict[str, Any], run_dir: Path) -> dict[str, float]:
    """A run's per-phase seconds (medians over its steps after the first), and the push's
    seconds per GB (from its rows: the result rounds the GB)."""
    out = {p: result[f"time_{p}_s"] for p in (*PHASES, *ENGINE) if f"time_{p}_s" in result}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_gb = [r["time_sync_push_s"] / r["perf/sync_gb"] for r in rows[1:] if r.get("perf/sync_gb")]
    if per_gb:
        out[SYNC_PER_GB] = statistics.median(per_gb)
    return out


def compare(runs: dict[str, list[dict[str, float]]], limit: float) -> list[dict[str, Any]]:
    """Per phase: each model's median over its runs, the median of the rounds' ratios, and
    ``slow`` past ``limit`` (the sync by its seconds per GB, not its seconds)."""
    rows = []
    for name in (*PHASES, SYNC_PER_GB, *ENGINE):
        pairs = [
            (a[name], b[name])
            for a, b in zip(runs[SLOW], runs[DENSE], strict=True)
            if name in a and name in b
        ]
        if not pairs:
            continue
        ratio = statistics.median(a / b if b > 0 else float("inf") for a, b in pairs)
        judged = name != "sync" or not any(SYNC_PER_GB in r for r in runs[SLOW])
        rows.append(
            {
                "phase": name,
                SLOW: statistics.median(a for a, _ in pairs),
                DENSE: statistics.median(b for _, b in pairs),
                "ratio": ratio,
                "slow": judged and ratio > limit,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="fsdp")
    p.add_argument("--repeats", type=int, default=3, help="rounds, each running both models")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per run (the first is warm-up)")
    p.add_argument("--rollout-batch-size", type=int, default=4)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-response-len", type=int, default=64)
    p.add_argument("--limit", type=float, default=3.0, help="a ratio past this names its phase")
    p.add_argument("--work-dir", default="/tmp/bench_tiny_families")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--out", help="write the runs and the table as JSON here")
    args = p.parse_args(argv)
    # what bench_grpo_e2e.run_backend reads of its arguments
    args.num_gpus, args.train_split, args.optimizer_cpu_offload = 0, "validation", False
    args.after_last_step, args.seed, args.extra = None, 0, []
    work = Path(args.work_dir)
    tokenizer = shared_dir() / "models" / "Qwen3-VL-4B-Instruct"
    models = {s: build_hf_folder(s, tokenizer, work / f"model_{s}", 0) for s in (SLOW, DENSE)}
    runs: dict[str, list[dict[str, float]]] = {SLOW: [], DENSE: []}
    lengths: dict[str, list[float]] = {SLOW: [], DENSE: []}
    raw = []
    for round_ in range(args.repeats):
        order = (SLOW, DENSE) if round_ % 2 == 0 else (DENSE, SLOW)  # neither always first
        for shape in order:
            args.work_dir = str(work / f"{shape}_{round_}")
            Path(args.work_dir).mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            result = run_backend(args, args.backend, models[shape])
            if result["returncode"] != 0 or result["steps_done"] < args.steps:
                sys.exit(f"{shape} run failed: {result.get('log_tail', result['log'])}")
            runs[shape].append(phase_times(result, Path(args.work_dir) / f"run_{args.backend}"))
            lengths[shape].append(result.get("response_length_mean", float("nan")))
            raw.append({"shape": shape, "round": round_, **result})
            print(f"{shape} round {round_}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = compare(runs, args.limit)
    print(
        f"\nbackend {args.backend}, {args.rollout_batch_size} prompts x {args.n_samples} samples, "
        f"{args.max_response_len} new tokens at most; median of {args.repeats} runs each"
    )
    for shape in (SLOW, DENSE):
        pushed = [r["perf/sync_gbps"] for r in raw if r["shape"] == shape and "perf/sync_gbps" in r]
        rate = f", weight push {statistics.median(pushed):.3f} GB/s" if pushed else ""
        print(
            f"  {shape}: {model_params(models[shape]) or 0:,} parameters, mean response "
            f"{statistics.median(lengths[shape]):.1f} tokens{rate}"
        )
    print(f"{'phase':<24} {SLOW + ' s':>16} {DENSE + ' s':>16} {'ratio':>7}")
    for row in table:
        flag = f"  <- past {args.limit:g}x" if row["slow"] else ""
        if row["phase"] == "sync" and not row["slow"] and row["ratio"] > args.limit:
            flag = "  (the bytes: judged per GB)"
        print(f"{row['phase']:<24} {row[SLOW]:16.3f} {row[DENSE]:16.3f} {row['ratio']:6.2f}x{flag}")
    slow = [r["phase"] for r in table if r["slow"]]
    print(f"slow phases: {', '.join(slow)}" if slow else f"no phase past {args.limit:g}x")
    if args.out:
        write_json(args.out, {"table": table, "runs": raw})


if __name__ == "__main__":
    main()
