"""Ray start-up: a start-up time-out is retried, then reported in one line; a local Ray started
by a driver leaves no process behind when that driver is killed with SIGKILL."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl_runtime import PreflightError, init_ray
from rl_runtime.ray_reaper import reap, session_pids

TIMED_OUT = "The current node timed out during startup. This could happen because..."


def _holder(path: Path) -> subprocess.Popen:
    """A real process with `path` open (as a Ray process has its log files open)."""
    code = (
        "import sys, time; f = open(sys.argv[1], 'a'); print('open', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_reaper_ends_the_session_processes_and_spares_the_rest(tmp_path):
    session, other = tmp_path / "session_1", tmp_path / "session_2"
    (session / "logs").mkdir(parents=True)
    other.mkdir()
    inside, spared = _holder(session / "logs" / "raylet.out"), _holder(session / "driver.log")
    outside = _holder(other / "raylet.out")
    try:
        assert session_pids(str(session)) == {inside.pid, spared.pid}
        assert reap(str(session), frozenset({spared.pid}), grace_s=10) == {inside.pid}
        assert inside.wait(timeout=30) == -signal.SIGTERM
        assert spared.poll() is None and outside.poll() is None
    finally:
        for proc in (inside, spared, outside):
            proc.kill()
            proc.wait()


def test_start_up_failures_end_in_one_line(monkeypatch):
    """Every attempt times out, leaving a half-started process (as Ray leaves its GCS and
    raylet): each is killed before the next try; after `attempts` tries, one line that says
    what to do."""
    import ray

    calls, started = [], []

    def timed_out(**kwargs):
        calls.append(kwargs)
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        raise Exception(TIMED_OUT + "\nmore detail")

    monkeypatch.setattr(ray, "init", timed_out)
    with pytest.raises(PreflightError) as err:
        init_ray(num_cpus=1, attempts=3, retry_wait_s=0)
    assert len(calls) == 3 and calls[0]["include_dashboard"] is False
    assert [proc.wait(timeout=60) for proc in started] == [-signal.SIGKILL] * 3
    message = err.value.message
    assert "\n" not in message and "timed out during startup" in message
    assert "start a local Ray in 3 attempts" in message and "--external-ray" in message
    assert f"on {os.cpu_count()} cores" in message  # busy or not, as measured
    assert not ray.is_initialized()


DRIVER = """
import os, sys, time
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
import ray
from rl_runtime import init_ray

real_init, failures = ray.init, []

def init_that_times_out_once(**kwargs):  # the busy machine's first start-up
    if not failures:
        failures.append(1)
        raise Exception({timed_out!r})
    return real_init(**kwargs)

ray.init = init_that_times_out_once
init_ray(num_cpus=1, retry_wait_s=0)

@ray.remote(num_cpus=0.1)
class Actor:
    def pid(self):
        return os.getpid()

actor = Actor.remote()
print("actor", ray.get(actor.pid.remote()), flush=True)
print("session", ray._private.worker._global_node.get_session_dir_path(), flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a real local Ray on shared cores
@pytest.mark.timeout(600)
def test_killed_driver_leaves_no_ray_process(tmp_path):
    """The driver's first start-up times out (injected) and the retry starts Ray; then the
    driver alone is SIGKILLed: every process with a file in its Ray session folder (GCS,
    raylet, agents, the actor) is gone soon after. Without the reaper the dashboard and
    runtime-env agents stayed for minutes."""
    import ray  # noqa: F401 (puts Ray's bundled psutil on the path)

    psutil = importlib.import_module("psutil")

    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(timed_out=TIMED_OUT)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        actor = int(driver.stdout.readline().split()[1])
        session = driver.stdout.readline().split()[1]
    except (IndexError, ValueError):
        driver.kill()
        pytest.fail(f"the driver did not start Ray:\n{driver.communicate()[1][-3000:]}")
    before = session_pids(session)
    assert actor in before and len(before) >= 4  # GCS, raylet, agents, the actor at least
    names = {psutil.Process(pid).name() for pid in before}
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    stderr = driver.stderr.read()
    assert "trying again (1/4)" in stderr

    def alive() -> list[int]:
        return [p for p in before if psutil.pid_exists(p) and _not_zombie(psutil, p)]

    deadline = time.monotonic() + 60  # a bound, not a measurement: the agents stayed minutes
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive()
    for pid in left:  # leave the machine clean even when the test fails
        psutil.Process(pid).kill()
    assert not left, f"Ray processes left after the driver's SIGKILL: {left}"
    assert not session_pids(session)


def _not_zombie(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
