"""What the benchmarks here share, so that each bench file keeps only its measurement.

- **Timing** (:class:`Timing`: the seconds of each call, median / min / mean / percentiles):
  :func:`timed` (one call between two device syncs), :func:`time_calls` (warm-up, then each
  repeat synchronised), :func:`time_rounds` (sides taking turns, so a burst of load from other
  jobs hits them alike), :func:`time_steps` (steps back to back, as a training loop runs them),
  :func:`event_seconds` (CUDA events: device time).
- **The device**: :func:`describe` (name, memory, the peak a run is measured against, the HBM
  bandwidth measured now), :func:`device_name`, :func:`peak_memory_gib`, :func:`release`.
- **The limits**: :data:`PEAK_BF16_FLOPS`, :func:`mfu`, :func:`copy_bandwidth_gb_s`,
  :func:`measure_hbm_bandwidth`, :func:`roofline` (achieved GB/s and FLOP/s as fractions of
  them). What a model must move or compute per step is in ``roofline.py``.
- **Results**: :func:`write_json`; :func:`in_fresh_process` and :func:`emit` (one measurement
  in a process of its own, its record on the last line of its output).
- **Flags and paths**: :func:`fill_unset` (defaults that depend on the device), :data:`ROOT`,
  :func:`shared_dir`, :func:`workspace_paths`.

Only the standard library is imported here; torch is imported where it is used, so a bench that
drives other processes (``bench_grpo_e2e``) or never touches torch (``bench_rewards``) starts
without it.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Dense bf16 peak of one H100 SXM or H200 (NVIDIA's datasheets: 1,979 TFLOP/s with 2:4
#: sparsity, half of it dense; the H200 is the same chip with more and faster memory): the
#: figure MFU is counted against in every bench and in docs/performance.md.
PEAK_BF16_FLOPS = 989e12


# ----------------------------------------------------------------------------------- timing


def _cuda(device: Any) -> bool:
    return device is not None and str(device).startswith("cuda")


def sync(device: Any = None) -> None:
    """Wait for ``device`` (a ``torch.device`` or its name) to finish; nothing off CUDA."""
    if _cuda(device):
        import torch

        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call, in order, and their summary (:meth:`of`)."""

    times: tuple[float, ...]
    median: float
    mean: float
    min: float
    max: float
    total: float

    @classmethod
    def of(cls, times: Iterable[float]) -> Timing:
        t = tuple(times)
        return cls(t, statistics.median(t), statistics.fmean(t), min(t), max(t), sum(t))

    def percentile(self, q: float) -> float:
        """The nearest-rank ``q`` quantile (0.5: the upper median, 0.99: p99)."""
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """(seconds, result) of one call of ``fn``, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def time_calls(
    fn: Callable[[], Any],
    device: Any = None,
    *,
    warmup: int = 0,
    repeats: int = 1,
    before: Callable[[], Any] | None = None,
) -> Timing:
    """``warmup`` untimed calls, then ``repeats`` timed ones, each between two device syncs.
    ``before`` runs untimed ahead of every call (the backward an optimizer step follows)."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        if i < warmup:
            fn()
        else:
            times.append(timed(fn, device)[0])
    return Timing.of(times)


def time_rounds(
    sides: Mapping[str, Callable[[], Any]], device: Any = None, repeats: int = 1
) -> dict[str, Timing]:
    """Each side once per round, the sides taking turns in every round: a burst of load from
    other jobs on a shared machine hits them alike instead of one of them."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            seconds[name].append(timed(fn, device)[0])
    return {name: Timing.of(values) for name, values in seconds.items()}


def time_steps(
    step: Callable[[], Any],
    device: Any = None,
    *,
    warmup: int = 0,
    steps: int = 1,
    quiet_gc: bool = False,
) -> Timing:
    """Seconds of each of ``steps`` steps run back to back, as a training loop runs them: the
    device is synchronised only before the first and after the last, so the host may prepare
    step i+1 while the device finishes step i (each step's own host reads still wait). Each
    interval is host time between step starts; the last runs to the final sync, so the
    intervals sum to the wall time of the run. ``quiet_gc``: Python's garbage collection off
    during the timed steps, after one collection, as ``rl_runtime.PeriodicGC`` runs a trainer."""
    for _ in range(warmup):
        step()
    frozen_before = gc.get_freeze_count() > 0  # left frozen if it was (a test session)
    if quiet_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    try:
        sync(device)
        marks = [time.perf_counter()]
        for _ in range(steps):
            step()
            marks.append(time.perf_counter())
        sync(device)
        marks[-1] = time.perf_counter()
    finally:
        if quiet_gc:
            if not frozen_before:
                gc.unfreeze()
            gc.enable()
    return Timing.of(b - a for a, b in itertools.pairwise(marks))


def event_seconds(fn: Callable[[], Any]) -> float:
    """Device seconds of the work ``fn`` launches on the current CUDA stream (two events)."""
    import torch

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


# ----------------------------------------------------------------------------------- device


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: Any = "cpu") -> str:
    """The GPU's name on CUDA; else the CPU's model."""
    if _cuda(device):
        import torch

        return torch.cuda.get_device_name(device)
    return _cpu_model()


@dataclass(frozen=True)
class Device:
    """What a run is measured on and against."""

    name: str
    memory_gib: float | None  # the GPU's memory; None on a CPU
    peak_flops: float | None  # dense bf16 (PEAK_BF16_FLOPS) on a GPU; None on a CPU
    hbm_gb_s: float | None  # measured in this run (measure_hbm_bandwidth), where asked

    def __str__(self) -> str:
        parts = [self.name]
        if self.memory_gib is not None:
            parts.append(f"{self.memory_gib:.1f} GiB")
        if self.peak_flops is not None:
            parts.append(f"peak {self.peak_flops / 1e12:g} TFLOP/s bf16")
        hbm = "not measured" if self.hbm_gb_s is None else f"{self.hbm_gb_s:.0f} GB/s measured"
        return ", ".join(parts) + f"; HBM bandwidth {hbm}"


def describe(device: Any, *, hbm_gib: float | None = None) -> Device:
    """The device's name, memory and bf16 peak; with ``hbm_gib``, its memory bandwidth measured
    now by a copy of that many GiB (run it before the model: the copy needs twice that free)."""
    if not _cuda(device):
        return Device(_cpu_model(), None, None, None)
    import torch

    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    bandwidth = measure_hbm_bandwidth(device, gib=hbm_gib) if hbm_gib else None
    return Device(device_name(device), memory, PEAK_BF16_FLOPS, bandwidth)


def peak_memory_gib(device: Any) -> float | None:
    """The most device memory allocated since the last reset (None off CUDA)."""
    if not _cuda(device):
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30


def reset_peak_memory(device: Any) -> None:
    if _cuda(device):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def release(device: Any, *, compiled: bool = False) -> float | None:
    """Free what the last measurement left (``compiled``: torch.compile's graphs too, which hold
    their modules) and start a new peak; returns the peak memory before (None off CUDA)."""
    if compiled:
        import torch._dynamo

        torch._dynamo.reset()
    gc.collect()
    peak = peak_memory_gib(device)
    if _cuda(device):
        import torch

        torch.cuda.empty_cache()
        reset_peak_memory(device)
    return peak


# ----------------------------------------------------------------------------------- limits


def mfu(flops_per_s: float, peak_flops: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops_per_s / peak_flops


def fraction(value: float | None, limit: float | None) -> float | None:
    """``value / limit``, None where either is missing (or zero)."""
    return value / limit if value and limit else None


def copy_bandwidth_gb_s(device: Any, gib: float, repeats: int) -> float:
    """Memory bandwidth in GB/s (1e9 bytes) of ``device`` measured now: the best of ``repeats``
    copies of a ``gib`` GiB buffer, each read and written (CUDA events on a GPU, wall time on a
    CPU). The best, so that a fraction of it is never flattered by a slow measurement."""
    import torch

    n = int(gib * 2**30)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    copy()  # warm
    if _cuda(device):
        best = min(event_seconds(copy) for _ in range(repeats))
    else:
        best = time_calls(copy, repeats=repeats).min
    del copy, src, dst
    if _cuda(device):
        torch.cuda.empty_cache()
    return 2 * n / best / 1e9


def measure_hbm_bandwidth(device: Any, gib: float = 4.0, repeats: int = 5) -> float | None:
    """Device-memory bandwidth in GB/s measured now on this chip (:func:`copy_bandwidth_gb_s`);
    None off CUDA (a host copy measures caches and NUMA, not the memory a CPU decode step
    streams)."""
    return copy_bandwidth_gb_s(device, gib, repeats) if _cuda(device) else None


def roofline(
    step_bytes: float,
    step_s: float | None,
    bandwidth_gb_s: float | None,
    flops: float,
    prefill_s: float | None,
    peak_tflops: float | None,
) -> dict[str, Any]:
    """Distance to the limits: GB/s achieved moving ``step_bytes`` in ``step_s`` and its
    fraction of the bandwidth; TFLOP/s achieved computing ``flops`` in ``prefill_s`` and its
    fraction of the peak (MFU). None where a time or a limit is missing."""
    gb_s = step_bytes / step_s / 1e9 if step_s else None
    tflops = flops / prefill_s / 1e12 if prefill_s else None
    return {
        "step_gb": step_bytes / 1e9,
        "gb_s": gb_s,
        "bw_frac": fraction(gb_s, bandwidth_gb_s),
        "prefill_tflop": flops / 1e12,
        "prefill_tflops": tflops,
        "mfu": fraction(tflops, peak_tflops),
    }


# ---------------------------------------------------------------------------------- results


def write_json(path: str | Path, record: Any) -> Path:
    """``record`` as indented JSON at ``path`` (its folder made), announced on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def emit(record: Any) -> None:
    """A worker's result: one JSON line on stdout, the last it prints (:func:`in_fresh_process`)."""
    print(json.dumps(record), flush=True)


def in_fresh_process(script: str | Path, argv: list[str]) -> Any:
    """Run ``script`` with ``argv`` in a fresh Python process (no allocator, compile or library
    state inherited from this one; its own peak memory) and return what it :func:`emit`-ted.
    Its log and errors go to this process's stderr."""
    cmd = [sys.executable, str(script), *argv]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------------- flags and paths


def fill_unset(args: Any, **defaults: Any) -> None:
    """Each of ``args``' ``defaults`` left None (its flag not given) takes the value here: the
    defaults that depend on the device or on another flag."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def shared_dir() -> Path:
    """The shared data and processor files: ``$GLIMPSE_SHARED``, else ``../shared``."""
    return Path(os.environ.get("GLIMPSE_SHARED", ROOT.parent / "shared")).resolve()


def workspace_paths() -> list[str]:
    """The workspace packages' source folders not yet on ``sys.path``: a bench run with a bare
    ``python`` still imports them (after what is installed, which wins)."""
    found = sorted(str(p) for p in (ROOT / "packages").glob("*/src"))
    return [p for p in found if p not in sys.path]
