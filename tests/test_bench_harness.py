"""``tools/bench/harness.py`` on the CPU: the timers against sleeps of known length, the JSON
writer and the fresh-process round trip, the roofline arithmetic, the device description; and
every bench still starts (its ``--help``)."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


harness = _load("harness")


def test_timing_statistics() -> None:
    t = harness.Timing.of([3.0, 1.0, 2.0, 4.0])
    assert (t.min, t.max, t.total) == (1.0, 4.0, 10.0)
    assert t.median == 2.5 and t.mean == 2.5
    assert t.percentile(0.5) == 3.0  # nearest rank: the upper median
    assert t.percentile(0.99) == 4.0
    assert t.percentile(0.0) == 1.0


def test_time_calls_warms_up_and_leaves_before_untimed() -> None:
    calls = []

    def fn() -> None:
        calls.append("fn")
        time.sleep(0.01)

    def before() -> None:
        calls.append("before")
        time.sleep(0.05)

    timing = harness.time_calls(fn, "cpu", warmup=2, repeats=3, before=before)
    assert calls == ["before", "fn"] * 5  # before ahead of every call, warm-up ones too
    assert len(timing.times) == 3  # the warm-up calls are not counted
    assert all(0.01 <= t < 0.05 for t in timing.times), timing.times  # fn only


def test_timed_returns_the_result() -> None:
    seconds, out = harness.timed(lambda: time.sleep(0.02) or 42)
    assert out == 42 and seconds >= 0.02


def test_time_rounds_takes_turns() -> None:
    order: list[str] = []
    sides = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    timings = harness.time_rounds(sides, repeats=3)
    assert order == ["a", "b"] * 3
    assert {k: len(t.times) for k, t in timings.items()} == {"a": 3, "b": 3}


def test_time_steps_intervals_add_up_to_the_run_and_gc_stays_quiet() -> None:
    enabled: list[bool] = []

    def step() -> None:
        enabled.append(gc.isenabled())
        time.sleep(0.01)

    start = time.perf_counter()
    timing = harness.time_steps(step, "cpu", warmup=2, steps=4, quiet_gc=True)
    wall = time.perf_counter() - start
    assert len(timing.times) == 4 and all(t >= 0.01 for t in timing.times)
    assert 0.04 <= timing.total <= wall  # the timed steps, not the warm-up ones
    assert enabled == [True, True, False, False, False, False]  # off for the timed steps only
    assert gc.isenabled()
    harness.time_steps(step, steps=1)
    assert enabled[-1] is True  # without quiet_gc nothing is switched


def test_write_json_makes_the_folder_and_round_trips(tmp_path, capsys) -> None:
    record = {"device": "x", "runs": [{"s": 1.5, "ratio": None}]}
    path = harness.write_json(tmp_path / "a" / "b" / "r.json", record)
    assert json.loads(path.read_text()) == record
    assert path.read_text().endswith("}\n")
    assert f"wrote {path}" in capsys.readouterr().out


def test_in_fresh_process_returns_what_the_worker_emitted(tmp_path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "from harness import emit\n"
        "print('a log line first')\n"
        "emit({'argv': sys.argv[1:], 'pid_differs': True})\n"
    )
    record = harness.in_fresh_process(worker, ["--only", "ours"])
    assert record == {"argv": ["--only", "ours"], "pid_differs": True}
    worker.write_text("raise SystemExit(3)\n")
    with pytest.raises(subprocess.CalledProcessError):
        harness.in_fresh_process(worker, [])


def test_roofline_arithmetic() -> None:
    roof = harness.roofline(2e9, 1e-3, 4000.0, 5e12, 0.01, 989.0)
    assert roof["step_gb"] == 2.0
    assert roof["gb_s"] == pytest.approx(2000.0)
    assert roof["bw_frac"] == pytest.approx(0.5)
    assert roof["prefill_tflops"] == pytest.approx(500.0)
    assert roof["mfu"] == pytest.approx(500 / 989)
    cpu = harness.roofline(2e9, 1e-3, None, 5e12, 0.01, None)
    assert cpu["gb_s"] == pytest.approx(2000.0)
    assert cpu["bw_frac"] is None and cpu["mfu"] is None
    untimed = harness.roofline(2e9, None, 4000.0, 5e12, None, 989.0)
    assert untimed["gb_s"] is None and untimed["mfu"] is None and untimed["prefill_tflop"] == 5.0
    assert harness.mfu(harness.PEAK_BF16_FLOPS / 4) == pytest.approx(0.25)
    assert harness.PEAK_BF16_FLOPS == 989e12  # what docs/performance.md's MFU column uses
    assert harness.fraction(3.0, 4.0) == 0.75
    assert harness.fraction(None, 4.0) is None and harness.fraction(3.0, None) is None


def test_roofline_table_reads_na_where_a_limit_is_missing() -> None:
    table = _load("roofline").format_table
    cpu = harness.roofline(2e9, 1e-3, None, 5e12, 0.01, None)
    row = {"batch": 2, "side": "eager", "step_ms": 1.0, "device_ms": None, "time": "wall"}
    lines = table([{**row, "roof": cpu}]).splitlines()
    assert "%BW" in lines[0] and "MFU" in lines[0]
    assert lines[1].split()[:4] == ["2", "eager", "1.00", "n/a"]
    assert lines[1].count("n/a") == 3  # device ms, %BW, MFU


def test_the_cpu_described() -> None:
    cpu = harness.describe("cpu", hbm_gib=1.0)
    assert cpu.name and cpu.name == harness.device_name("cpu")
    assert cpu.memory_gib is None and cpu.peak_flops is None and cpu.hbm_gb_s is None
    assert str(cpu).endswith("HBM bandwidth not measured")
    assert harness.measure_hbm_bandwidth("cpu") is None  # a host copy is not a decode step's
    assert harness.peak_memory_gib("cpu") is None and harness.release("cpu") is None
    rate = harness.copy_bandwidth_gb_s("cpu", gib=1 / 64, repeats=2)
    assert 0.05 < rate < 10_000  # GB/s of a 16 MiB host copy, read and write counted


def test_fill_unset_keeps_what_was_given() -> None:
    args = argparse.Namespace(batch=None, steps=0, preset="given")
    harness.fill_unset(args, batch=8, steps=10, preset="default")
    assert vars(args) == {"batch": 8, "steps": 0, "preset": "given"}  # only None is unset


def test_paths(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GLIMPSE_SHARED", str(tmp_path))
    assert harness.shared_dir() == tmp_path.resolve()
    monkeypatch.delenv("GLIMPSE_SHARED")
    assert harness.shared_dir() == (ROOT.parent / "shared").resolve()
    monkeypatch.setattr(sys, "path", [str(ROOT / "packages" / "rl-algos" / "src")])
    paths = harness.workspace_paths()
    assert str(ROOT / "packages" / "vlm-models" / "src") in paths
    assert str(ROOT / "packages" / "rl-algos" / "src") not in paths  # already there


BENCHES = sorted(p.name for p in BENCH.glob("bench_*.py"))


@pytest.mark.slow  # a Python process per bench, most importing torch
@pytest.mark.parametrize("bench", BENCHES)
def test_every_bench_starts(bench: str) -> None:
    """Each bench imports (the harness, its own modules) and parses its flags."""
    done = subprocess.run(
        [sys.executable, str(BENCH / bench), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]
