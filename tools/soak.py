"""Soak: the tiny GRPO preset for many steps, watched from outside for leaks.

Runs `apps/geo3k_grpo --preset tiny` (300 GRPO steps by default, a checkpoint every 10, three
evaluations) as a child process and samples, from outside, the resident memory and open file
descriptors of the driver and of every Ray actor process at a baseline step (20) and at the
last step but one (the last is followed at once by the final save and the shutdown). It checks
that each process's memory at the end is within `--tolerance` (10%) of the baseline, that no
process holds more than a few more file descriptors than at the baseline, and that once the
launcher has exited no process it started is left running. Prints a table and writes JSON.

    uv run tools/soak.py                         # the full soak (about an hour on 2 cores)
    uv run tools/soak.py --steps 30 --json /tmp/soak_short.json

Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
#: Ray's own processes with a `ray::` title that are not our actors.
RAY_DAEMONS = {"IDLE", "DashboardAgent", "RuntimeEnvAgent"}
#: Open files a process may hold at the end beyond its baseline (a save in flight, a log
#: rotation); a leak of one per checkpoint over 280 steps is 28.
FD_SLACK = 5


@dataclass
class Sample:
    """One process at one moment."""

    pid: int
    role: str  # "driver", or the Ray actor class ("TrainWorker", "EngineWorker", ...)
    rss_mb: float
    num_fds: int


@dataclass
class Report:
    steps: int
    baseline_step: int
    end_step: int
    tolerance: float
    wall_s: float = 0.0
    exit_code: int | None = None
    baseline: list[Sample] = field(default_factory=list)
    end: list[Sample] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _role(proc: psutil.Process, driver_pid: int) -> str | None:
    """The driver, a Ray actor (its process title is `ray::Class.method` or `ray::Class`), or
    None for Ray's own daemons and idle workers."""
    if proc.pid == driver_pid:
        return "driver"
    try:
        title = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if not title.startswith("ray::"):
        return None
    role = title[5:].split(".")[0].split()[0]
    return None if role in RAY_DAEMONS else role


def _driver(launcher: psutil.Process) -> psutil.Process:
    """The Python process running the app (under `uv run`, a child of uv)."""
    for p in [launcher, *launcher.children(recursive=True)]:
        try:
            if any("geo3k_grpo" in a for a in p.cmdline()) and "python" in p.name().lower():
                return p
        except psutil.NoSuchProcess:
            continue
    return launcher


def _sample(launcher: psutil.Process, seen: dict[int, tuple[float, str]]) -> list[Sample]:
    driver = _driver(launcher)
    out = []
    for p in [driver, *driver.children(recursive=True)]:
        try:
            seen.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:80]))
            role = _role(p, driver.pid)
            if role is None:
                continue
            out.append(Sample(p.pid, role, p.memory_info().rss / 2**20, p.num_fds()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _rows(metrics: Path) -> int:
    try:
        return len(metrics.read_text().splitlines())
    except FileNotFoundError:
        return 0


def _left_running(seen: dict[int, tuple[float, str]]) -> list[str]:
    """Processes started during the run that are still alive (same pid and start time)."""
    alive = []
    for pid, (created, cmd) in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {cmd}")
        except psutil.NoSuchProcess:
            continue
    return alive


def _check(report: Report) -> None:
    base = {s.pid: s for s in report.baseline}
    for s in report.end:
        b = base.get(s.pid)
        if b is None:
            continue  # an actor that started after the baseline (none expected)
        if s.rss_mb > b.rss_mb * (1 + report.tolerance):
            report.failures.append(
                f"{s.role} (pid {s.pid}) grew from {b.rss_mb:.0f} to {s.rss_mb:.0f} MiB "
                f"(+{100 * (s.rss_mb / b.rss_mb - 1):.1f}%)"
            )
        if s.num_fds > b.num_fds + FD_SLACK:
            report.failures.append(
                f"{s.role} (pid {s.pid}) holds {s.num_fds} fds at the end, {b.num_fds} before"
            )
    missing = set(base) - {s.pid for s in report.end}
    for pid in missing:
        report.failures.append(f"{base[pid].role} (pid {pid}) disappeared during the run")
    if report.left_running:
        report.failures.append(f"{len(report.left_running)} process(es) left running after exit")
    if report.exit_code != 0:
        report.failures.append(f"the launcher exited {report.exit_code}")


def _table(report: Report) -> str:
    base = {s.pid: s for s in report.baseline}
    lines = [
        f"{'process':<14} {'pid':>8} {'RSS@' + str(report.baseline_step):>10} "
        f"{'RSS@' + str(report.end_step):>10} {'change':>8} {'fds':>9}",
    ]
    for s in sorted(report.end, key=lambda s: (s.role != "driver", s.role, s.pid)):
        b = base.get(s.pid)
        if b is None:
            continue
        change = 100 * (s.rss_mb / b.rss_mb - 1)
        lines.append(
            f"{s.role:<14} {s.pid:>8} {b.rss_mb:>8.0f}Mi {s.rss_mb:>8.0f}Mi {change:>+7.1f}% "
            f"{b.num_fds:>4}>{s.num_fds:<4}"
        )
    return "\n".join(lines)


def soak(args: argparse.Namespace) -> Report:
    baseline_step = args.baseline_step or (20 if args.steps >= 40 else max(1, args.steps // 3))
    report = Report(args.steps, baseline_step, args.steps - 1, args.tolerance)
    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="glimpse_soak_"))
    if out_dir.exists() and not args.keep_output:
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    uv = shutil.which("uv")
    cmd = [uv, "run", "apps/geo3k_grpo"] if uv else [sys.executable, "apps/geo3k_grpo"]
    cmd += [
        "--preset", "tiny",
        "--num-rollout", str(args.steps),
        "--save-interval", "10",
        "--eval-interval", str(max(1, args.steps // 3)),
        "--ray-num-cpus", str(args.ray_num_cpus),
        "--output-dir", str(out_dir),
    ]  # fmt: skip
    print("running:", " ".join(cmd), flush=True)
    metrics = out_dir / "metrics.jsonl"
    seen: dict[int, tuple[float, str]] = {}
    t0 = time.monotonic()
    with open(args.log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        launcher = psutil.Process(proc.pid)
        while proc.poll() is None:
            rows = _rows(metrics)
            if not report.baseline and rows >= baseline_step:
                report.baseline = _sample(launcher, seen)
                print(f"step {rows}: baseline sampled", flush=True)
            # The last step's row is followed at once by the final save, export and shutdown,
            # so the end is sampled at the step before it, while every actor still runs.
            if rows >= args.steps - 1 and report.baseline and not report.end:
                report.end = _sample(launcher, seen)
                print(f"step {rows}: end sampled", flush=True)
            elif rows:
                _sample(launcher, seen)  # remember every pid the run starts
            time.sleep(args.poll_s)
        report.exit_code = proc.returncode
    report.wall_s = time.monotonic() - t0
    time.sleep(args.grace_s)  # let Ray's daemons finish exiting
    report.left_running = _left_running(seen)
    _check(report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="GRPO steps (default 300)")
    ap.add_argument("--baseline-step", type=int, default=None, help="default 20")
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed RSS growth (0.10)")
    ap.add_argument("--ray-num-cpus", type=int, default=2)
    ap.add_argument("--output-dir", default=None, help="run folder (default: a temp folder)")
    ap.add_argument("--keep-output", action="store_true", help="do not clear a reused folder")
    ap.add_argument("--log", default="/tmp/glimpse_soak.log", help="the launcher's output")
    ap.add_argument("--json", default="/tmp/glimpse_soak.json", help="where to write results")
    ap.add_argument("--poll-s", type=float, default=2.0)
    ap.add_argument("--grace-s", type=float, default=10.0, help="wait after exit, then check")
    args = ap.parse_args(argv)
    report = soak(args)
    print(_table(report))
    print(f"wall {report.wall_s:.0f} s, exit code {report.exit_code}")
    for line in report.left_running:
        print("left running:", line)
    for line in report.failures:
        print("FAIL:", line)
    Path(args.json).write_text(json.dumps(asdict(report), indent=1))
    print("results:", args.json)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
