"""The whole GRPO step, as a user runs it: the launcher itself, phase by phase, per backend.

Builds an HF folder from a shape preset (random weights, the real Qwen3-VL tokenizer and
processor), then runs ``apps/geo3k_grpo`` on it for ``--steps`` GRPO steps on Geometry3K rows,
colocated, once per backend, in fresh processes. While each run goes, a thread samples the
GPU's used memory (``nvidia-smi``, every process together: trainer, engine, Ray). Prints each
backend's per-phase times (median over the steps after the first), the optimizer step's time
(``perf/optimizer_s``), the train phase's MFU (6 x parameters x tokens / time / 989 TFLOP/s,
``harness.PEAK_BF16_FLOPS``), peak GPU memory and peak host memory (the resident set of the
launcher's whole process tree: Ray, trainer, engine, sampled with psutil; pinned buffers
count), and writes them as JSON.

Data and tokenizer come from ``GLIMPSE_SHARED`` (default ``../shared``): ``models/Qwen3-VL-4B-
Instruct`` (every Qwen3-VL size shares its tokenizer and processor) and ``data/geo3k``.

    # H200: the 2B shape, 16 prompts x 8 samples, 384-token responses, 5 steps, both backends
    python3 tools/bench/bench_grpo_e2e.py --out e2e.json
    # CPU smoke run: a tiny model, 2 steps
    uv run python tools/bench/bench_grpo_e2e.py --shape qwen3-vl-tiny --num-gpus 0 --steps 2 \
        --rollout-batch-size 2 --n-samples 2 --max-response-len 8
    # H200: the slime recipe's Qwen3.5-35B-A3B cut to 8 layers, on the Megatron backend
    python3 tools/bench/bench_grpo_e2e.py --shape qwen3.5-35b-a3b --layers 8 --backends megatron
    # H200 with 128 GiB of host memory: the full-size 8B, the optimizer partly on the host
    # (the launcher's estimate picks the fraction; --optimizer-cpu-offload makes it explicit)
    python3 tools/bench/bench_grpo_e2e.py --shape qwen3-vl-8b --optimizer-cpu-offload \
        --timeout 1800 --out e2e_8b.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

from harness import ROOT, device_name, mfu, shared_dir, write_json

PHASES = ("rollout", "reward", "onload", "logprobs", "train", "sync")
#: The sync phase's parts (colocated): the engine's memory back, the weights, the trainer's offload.
SYNC_PARTS = ("sync_resume", "sync_push", "sync_offload")
# the engines' split of the rollout (rl_runtime.loop._engine_stats): seconds and counts
ENGINE_KEYS = ("time_rollout_engine", "rollout_prefills", "rollout_decode_steps", "rollout_graph")
#: the whole GRPO step's seconds in metrics.jsonl (the report's ``grpo_step_s``)
GRPO_STEP = "perf/grpo_step_s"
# the trainer's state over the host link (trainer_core.offload.transfer_metrics): GB, s, GB/s;
# the weight push's GB and GB/s (rl_runtime.loop; its seconds are time_sync_push_s)
TRANSFER_KEYS = tuple(
    f"perf/{d}_{u}" for d in ("onload", "offload", "sync") for u in ("gb", "s", "gbps")
)


def build_hf_folder(
    shape: str,
    tokenizer: Path,
    out: Path,
    seed: int,
    layers: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """A loadable HF folder: the preset's config with random weights, and the real processor.
    Built in a child process, so this one holds no GPU memory while the runs go (it held
    5 GiB through every run: the engine's KV cache is sized from what is free).
    ``overrides``: config keys to set (``vlm_models.presets.apply_overrides``), e.g. a shape
    shrunk for a CPU."""
    if not (out / "config.json").is_file():
        ctx = multiprocessing.get_context("spawn")
        args = (shape, tokenizer, out, seed, layers, overrides or {})
        child = ctx.Process(target=_build_hf_folder, args=args)
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"building the {shape} folder failed (exit {child.exitcode})")
    return out


def _build_hf_folder(
    shape: str,
    tokenizer: Path,
    out: Path,
    seed: int,
    layers: int | None,
    overrides: dict[str, Any],
) -> None:
    import torch

    from vlm_data.processor import build_processor
    from vlm_data.tokens import model_token_ids
    from vlm_models.build import build_model
    from vlm_models.presets import apply_overrides, preset_config

    torch.manual_seed(seed)
    processor = build_processor(str(tokenizer))
    # a recipe shape cut to `layers` decoder layers (Qwen3.5 keeps its layer pattern)
    config = preset_config(shape, **({"num_hidden_layers": layers} if layers else {}))
    # the image placeholders the processor writes (Qwen3.5's own tokenizer numbers them
    # otherwise; the shape's vocabulary, which holds them, stays)
    ids = model_token_ids(processor)
    vision = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    config = apply_overrides(config, {**overrides, **{k: ids[k] for k in vision}})
    device = "cuda" if torch.cuda.is_available() else None  # random init on the GPU: seconds
    model = build_model(config, dtype=torch.bfloat16, device=device)
    model.save_pretrained(out)
    processor.save_pretrained(out)


class PeriodicSampler:
    """Calls ``sample()`` every ``period`` s on a daemon thread between ``__enter__`` and
    ``__exit__``; a sampler without its tool (``available`` False) does nothing."""

    available = True

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def __enter__(self) -> Self:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()


class HostMemorySampler(PeriodicSampler):
    """Peak resident memory of a process and all its descendants (psutil): the host side of an
    offloaded optimizer, the engine's parked weights and Ray together."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(period)
        self.peak_bytes = 0
        self.pid: int | None = None
        try:
            import psutil  # noqa: F401
        except ImportError:  # pip install psutil (a dev dependency of the workspace)
            self.available = False

    def sample(self) -> None:
        import psutil

        if self.pid is None:
            return
        try:
            root = psutil.Process(self.pid)
            total = 0
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):  # it ended meanwhile
                    total += proc.memory_info().rss
            self.peak_bytes = max(self.peak_bytes, total)
        except psutil.Error:
            pass


class GpuMemorySampler(PeriodicSampler):
    """Peak GPU memory in use, in total and per process (trainer, engine), from ``nvidia-smi``:
    the per-process peaks show which side of a colocated step holds what."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(period)
        self.peak_mib = 0
        self.peak_by_pid: dict[str, int] = {}
        self.available = shutil.which("nvidia-smi") is not None

    def _query(self, what: str) -> list[list[str]]:
        cmd = ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    def sample(self) -> None:
        try:
            used = self._query("gpu=memory.used")
            self.peak_mib = max([self.peak_mib, *(int(row[0]) for row in used)])
            for pid, mib in self._query("compute-apps=pid,used_memory"):
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), int(mib))
        except (subprocess.SubprocessError, ValueError):
            pass


def model_params(model: Path) -> int | None:
    """Parameters of the HF folder's model (from its safetensors headers, no weights read)."""
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total or None


def launcher_command(args: argparse.Namespace, backend: str, model: Path, run_dir: Path) -> list:
    data = shared_dir() / "data" / "geo3k"
    return [
        sys.executable,
        str(ROOT / "apps" / "geo3k_grpo"),
        "--backend", backend,
        "--model-name", str(model),
        "--dataset", str(data),
        "--train-split", args.train_split,
        "--num-gpus", str(args.num_gpus),
        "--num-rollout", str(args.steps),
        "--rollout-batch-size", str(args.rollout_batch_size),
        "--n-samples-per-prompt", str(args.n_samples),
        "--global-batch-size", str(args.rollout_batch_size * args.n_samples),
        "--rollout-max-response-len", str(args.max_response_len),
        "--rollout-engine", "hf",
        "--eval-interval", "0",
        "--save-interval", "0",
        "--warmup-sft-steps", "0",
        "--output-dir", str(run_dir),
        *(["--optimizer-cpu-offload"] if args.optimizer_cpu_offload else []),
        *args.extra,
    ]  # fmt: skip


def _rows_logged(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def _node_memory_gib() -> float | None:
    """The node's memory (the peak's denominator: the launcher's plan caps it at 85 %)."""
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.virtual_memory().total / 2**30, 1)


def wait_for_run(
    proc: subprocess.Popen, metrics: Path, args: argparse.Namespace, seen: dict[str, float]
) -> str | None:
    """Wait for the launcher; None if it ended by itself. ``"timeout"`` past ``--timeout``;
    ``"after_last_step"`` when ``--after-last-step S`` is set and the run is still busy (its
    final checkpoint and export) S seconds after the last step's row was written. Sets
    ``seen["first_row"]``: seconds from the call to the first step's row (a user's wait from
    launch to the first step logged)."""
    start = time.monotonic()
    deadline = start + args.timeout
    last_row_at = None
    while proc.poll() is None:
        now = time.monotonic()
        if now > deadline:
            return "timeout"
        if "first_row" not in seen and _rows_logged(metrics) >= 1:
            seen["first_row"] = now - start
        if args.after_last_step is not None:
            if last_row_at is None and _rows_logged(metrics) >= args.steps:
                last_row_at = now
            if last_row_at is not None and now - last_row_at > args.after_last_step:
                return "after_last_step"
        time.sleep(0.5)
    return None


def run_backend(args: argparse.Namespace, backend: str, model: Path) -> dict[str, Any]:
    run_dir = Path(args.work_dir) / f"run_{backend}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = launcher_command(args, backend, model, run_dir)
    print("+", " ".join(cmd), flush=True)
    log_path = Path(args.work_dir) / f"{backend}.log"
    start = time.perf_counter()
    timed_out = False
    with GpuMemorySampler() as mem, HostMemorySampler() as host, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        host.pid = proc.pid
        seen: dict[str, float] = {}
        stopped = wait_for_run(proc, run_dir / "metrics.jsonl", args, seen)
        timed_out = stopped == "timeout"
        if stopped:  # keep what the finished steps logged
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.perf_counter() - start
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    result: dict[str, Any] = {
        "backend": backend,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "steps_done": len(rows),
        "timed_out": timed_out,
        "stopped_after_last_step": stopped == "after_last_step",
        "peak_gpu_mib": mem.peak_mib if mem.available else None,
        "peak_gpu_mib_by_pid": mem.peak_by_pid,
        "peak_host_gib": round(host.peak_bytes / 2**30, 1) if host.available else None,
        "node_host_gib": _node_memory_gib(),
        "log": str(log_path),
    }
    if proc.returncode != 0 and not stopped:
        result["log_tail"] = log_path.read_text()[-4000:]
    steady = rows[1:] or rows  # the first step includes compilation and allocator warm-up
    for key in (*(f"time_{p}_s" for p in (*PHASES, *SYNC_PARTS)), GRPO_STEP):
        values = [r[key] for r in steady if key in r]
        if values:
            result[key.removeprefix("perf/")] = round(statistics.median(values), 3)
    engine = sorted({k for r in steady for k in r if k.startswith(ENGINE_KEYS)})
    for key in (
        "train_tokens_per_s",
        "rollout_tokens_per_s",
        "response_length_mean",
        *TRANSFER_KEYS,
        *engine,
    ):
        values = [r[key] for r in steady if key in r]
        if values:
            result[key] = round(statistics.median(values), 2)
    values = [r["perf/optimizer_s"] for r in steady if "perf/optimizer_s" in r]
    if values:  # the mean over a step's optimizer steps, then the median over steps
        result["optimizer_s"] = round(statistics.median(values), 3)
    params = model_params(model)
    if params and "train_tokens_per_s" in result:
        gpus = max(1, args.num_gpus)
        result["train_mfu"] = round(mfu(6 * params * result["train_tokens_per_s"] / gpus), 4)
    result["first_step_s"] = round(rows[0][GRPO_STEP], 2) if rows else None
    first_row = seen.get("first_row")
    result["launch_to_first_step_s"] = round(first_row, 1) if first_row is not None else None
    # each step's phases too: a recompile or an allocator stall in one step moves the median of
    # the step but of no phase, so the medians alone need not add up
    step_keys = [f"time_{p}_s" for p in PHASES] + [GRPO_STEP]
    # and what each step computed on: its samples (and the completions dropped before the
    # reward: a random-init model samples an image placeholder now and then), their mean
    # length, the engine/trainer gap
    checks = (
        "num_samples",
        "malformed_completions",
        "response_length_mean",
        "rollout_logprob_abs_diff",
    )
    result["steps"] = [
        {k.removeprefix("perf/"): round(r[k], 3) for k in step_keys if k in r}
        | {k: r[k] for k in checks if k in r}
        for r in rows
    ]
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3-vl-2b", help="vlm_models shape or tiny preset")
    p.add_argument(
        "--layers", type=int, help="cut the shape to this many decoder layers (MoE, Qwen3.5)"
    )
    p.add_argument("--backends", default="fsdp,megatron")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rollout-batch-size", type=int, default=16)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=384)
    p.add_argument("--train-split", default="validation", help="geo3k split to sample from")
    p.add_argument("--work-dir", default="/tmp/bench_grpo_e2e")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per backend")
    p.add_argument(
        "--after-last-step",
        type=float,
        help="stop a run this many seconds after its last step is logged (its final save and "
        "export are then cut short: a timing run that need not wait for them)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="pass --optimizer-cpu-offload to the launcher (the optimizer state partly or "
        "wholly on the host; without it the launcher still picks it where the GPU cannot hold "
        "the state)",
    )
    p.add_argument(
        "--prune-models",
        action="store_true",
        help="delete the work dir's other shapes' model folders first (the GPU machine's 64 GiB "
        "disk held the 8B and 4B folders and a run's checkpoints, and the next shape's failed)",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("extra", nargs="*", help="more launcher flags, after --")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = shared_dir() / "models" / "Qwen3-VL-4B-Instruct"
    t0 = time.perf_counter()
    name = f"model_{args.shape}" + (f"_{args.layers}l" if args.layers else "")
    if args.prune_models:
        for old in work.glob("model_*"):
            if old.name != name and old.is_dir():
                shutil.rmtree(old)
    model = build_hf_folder(args.shape, tokenizer, work / name, args.seed, args.layers)
    print(f"model folder {model} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    results = []
    for backend in (b for b in args.backends.split(",") if b):
        results.append(run_backend(args, backend, model))
        if args.out:  # written after each backend, so a cut-short call keeps what finished
            write_results(Path(args.out), args, results)
    header = f"{'backend':<9} {'rc':>3} {'steps':>5} {'step_s':>7} " + " ".join(
        f"{ph:>9}" for ph in PHASES
    )
    print(
        header + f" {'train tok/s':>11} {'MFU':>6} {'opt s':>6} {'peak GiB':>8} {'host GiB':>8}"
        f" {'on GB/s':>8} {'off GB/s':>8}"
    )
    for r in results:
        phases = " ".join(f"{r.get(f'time_{ph}_s', float('nan')):9.2f}" for ph in PHASES)
        peak = r["peak_gpu_mib"] / 1024 if r["peak_gpu_mib"] else float("nan")
        host = r["peak_host_gib"] if r["peak_host_gib"] is not None else float("nan")
        mfu = 100 * r.get("train_mfu", float("nan"))
        print(
            f"{r['backend']:<9} {r['returncode']:>3} {r['steps_done']:>5} "
            f"{r.get('grpo_step_s', float('nan')):7.2f} {phases} "
            f"{r.get('train_tokens_per_s', float('nan')):11.0f} {mfu:5.1f}% "
            f"{r.get('optimizer_s', float('nan')):6.2f} {peak:8.1f} {host:8.1f} "
            f"{r.get('perf/onload_gbps', float('nan')):8.1f} "
            f"{r.get('perf/offload_gbps', float('nan')):8.1f}"
        )
        moved = ", ".join(
            f"{d} {r[f'perf/{d}_gb']:.1f} GB in {r[f'perf/{d}_s']:.2f} s"
            for d in ("onload", "offload")
            if f"perf/{d}_gb" in r
        )
        if moved:
            print(f"    {r['backend']} trainer state over the host link: {moved}")
        if "log_tail" in r:
            print(f"--- {r['backend']} failed; log tail:\n{r['log_tail']}")
        sync = ", ".join(f"{k} {r[f'time_{k}_s']:.2f}" for k in SYNC_PARTS if f"time_{k}_s" in r)
        if sync:
            print(f"    {r['backend']} sync parts (s): {sync}")
        engine = ", ".join(f"{k} {v}" for k, v in r.items() if k.startswith(ENGINE_KEYS))
        if engine:
            print(f"    {r['backend']} rollout, the engine's account: {engine}")
        for i, row in enumerate(r.get("steps", []), 1):
            parts = " ".join(f"{k[5:-2]} {v:.2f}" for k, v in row.items())
            print(f"    {r['backend']} step {i}: {parts}")


def write_results(path: Path, args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    meta = {
        "shape": args.shape,
        "layers": args.layers,
        "optimizer_cpu_offload": args.optimizer_cpu_offload,
        "python": platform.python_version(),
        "argv": sys.argv,
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = device_name("cuda")
    except ImportError:
        pass
    write_json(path, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
