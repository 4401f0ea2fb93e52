"""The launchers on a Ray cluster the user started, as a user starts it: a head and a second
node, each a real raylet started by `ray start` (on this one machine), told apart by custom
resources (`node_a` on the head, `node_b` on the other), with token authentication on (the
token in the head user's ``~/.ray/auth_token``, here a temporary HOME).

- joining: the right token from ``~/.ray/auth_token`` with nothing else set; a wrong token, no
  token and an address where nothing listens each end in one line within seconds;
- `--print-config` shows the placement plan on the cluster; an impossible plan is refused before
  any model loads;
- the tiny SFT run with its trainer on the second node, and the tiny GRPO run with the trainer
  on the head and the engine on the second node (not colocated; the weights cross between the
  nodes through Ray's object store), each actor's node read back from the actors themselves;
- a lost node (its raylet killed) ends the run in one line naming the engine, then the trainer
  rank, it held; `--resume` continues. One GRPO run serves both: it starts from the SFT folder
  with its engine on a third node; resumed with its trainer on another third node; resumed
  again on the head and the second node, where it is the two-node GRPO run above.

The head's GCS declares a node dead after 3 failed health checks 1 s apart (Ray's defaults: 5,
3 s apart), so that a killed raylet is seen in seconds.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ray start --block ...`: the node lives as long as this process (SIGTERM stops it). A
    node that joins a loaded head can give up waiting for the GCS (`Failed to get node info`:
    30 s while the other test process ran a launcher on both cores, 2026-12-07); it is
    started again, up to three times in all, anything else fails at once."""
    attempt = 0
    while True:
        attempt += 1
        with log.open("w") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [str(RAY), "start", "--block", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        if "Ray runtime started" in text:
            return proc
        assert "Failed to get node info" in text and attempt < 3, text[-3000:]


def _stop(*procs: subprocess.Popen) -> None:
    """SIGTERM to every node's `ray start --block` at once: each stops its own processes (in
    seconds; the same signal to its whole process group took 30)."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        proc.terminate()
    for proc in live:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, env of a user on the head machine, the two node processes)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GEO3K_"))}
    env |= {"HOME": str(home), "RAY_AUTH_MODE": "token"}  # for `ray start` only (see below)
    port = _free_port()
    logs = tmp_path_factory.mktemp("nodes")
    fast = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    head = _start(
        [
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            '--resources={"node_a": 1}',
            "--include-dashboard=false",
        ],
        env | fast,  # the GCS runs the health checks
        logs / "head.log",
    )
    worker = None
    try:
        worker = _start(
            [f"--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"node_b": 1}'],
            env,
            logs / "worker.log",
        )
        user = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}  # as a user's shell
        yield f"127.0.0.1:{port}", user, (head, worker)
    finally:
        _stop(*(p for p in (worker, head) if p is not None))
        # `ray stop` would remove the address `ray start` recorded; a later bare `ray.init()`
        # on this machine would try to join it (init_ray starts its own: address "local")
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()


def _launch(app: str, argv: list[str], env: dict[str, str], timeout: float = 600):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, f"apps/{app}", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def _error_line(proc: subprocess.CompletedProcess, app: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{app}: error: ")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("wrong token", "refused this driver's authentication token"),
        ("no token", "requires an authentication token"),
        ("token mode, no token", "RAY_AUTH_MODE=token is set but no token was found"),
        ("nothing listening", "nothing answers at Ray address"),
    ],
)
def test_joining_fails_in_one_line_within_seconds(cluster, tmp_path, case, message):
    address, env, _ = cluster
    if case == "wrong token":
        env = env | {"RAY_AUTH_TOKEN": secrets.token_hex(32)}
    elif case == "no token":
        env = env | {"HOME": str(tmp_path)}
    elif case == "token mode, no token":
        env = env | {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}
    else:
        address = f"127.0.0.1:{_free_port()}"
    argv = ["--preset", "tiny", "--ray-address", address, "--output-dir", str(tmp_path / "run")]
    proc, _ = _launch("geo3k_grpo", argv, env, timeout=60)
    assert message in _error_line(proc, "geo3k_grpo")
    assert "trying again" not in proc.stderr  # one attempt: retrying cannot change the answer
    assert not (tmp_path / "run" / "sft_warmup" / "hf").exists()


def test_print_config_shows_the_placement_plan(cluster, tmp_path):
    address, env, _ = cluster
    argv = ["--preset", "tiny", "--ray-address", address, "--no-colocate"]
    argv += ["--trainer-resource", "node_a", "--rollout-resource", "node_b", "--print-config"]
    proc, _ = _launch("geo3k_grpo", argv, env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)["placement"]
    assert [(r["role"], r["node_resources"]) for r in plan] == [
        ("trainer", ["node_a"]),
        ("engine", ["node_b"]),
    ]


def test_an_impossible_plan_is_refused_before_any_model_loads(cluster, tmp_path):
    address, env, _ = cluster
    argv = ["--preset", "tiny", "--ray-address", address, "--output-dir", str(tmp_path)]
    argv += ["--cpu-trainers", "2", "--trainer-resource", "node_c"]
    proc, _ = _launch("geo3k_sft", argv, env, timeout=120)
    line = _error_line(proc, "geo3k_sft")
    assert "node_c 0 of 0.002" in line and "2 bundle(s)" in line, line
    assert not (tmp_path / "checkpoints").exists()


def _placed(run_dir: Path) -> dict:
    placed = json.loads((run_dir / "placement.json").read_text())
    labels = {r["node_id"]: r["node_resources"] for r in placed["plan"]}
    return {kind: [labels[n] for n in ids] for kind, ids in placed["actors"].items()}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last_checkpoint(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (0: none)."""
    done = [p.name for p in (run_dir / "checkpoints").glob("step_*") if "." not in p.name]
    return max((int(name.split("_")[1]) for name in done), default=0)


@pytest.fixture(scope="module")
def sft(cluster, tmp_path_factory) -> Path:
    """The tiny SFT run with its trainer on node_b; two steps make the folder GRPO loads."""
    address, env, _ = cluster
    sft = tmp_path_factory.mktemp("sft")
    argv = ["--preset", "tiny", "--ray-address", address, "--output-dir", str(sft)]
    argv += ["--trainer-resource", "node_b", "--sft-num-steps", "2"]
    proc, _ = _launch("geo3k_sft", argv, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return sft


def _lose_node(address, env, argv, lost, log: Path) -> tuple[int, str]:
    """GRPO (`argv`) with the actor that `lost` places (`--rollout-resource` or
    `--trainer-resource`) on a fresh third node; its raylet is killed once the run saved a
    checkpoint newer than the folder held. Returns the exit status and stderr."""
    import psutil

    run = Path(argv[argv.index("--output-dir") + 1])
    before = _last_checkpoint(run)
    third = _start(
        [f"--address={address}", "--num-cpus=1", '--resources={"node_lost": 1}'],
        env | {"RAY_AUTH_MODE": "token"},
        log.with_suffix(".node.log"),
    )
    try:
        with log.open("w") as err:  # a file: a pipe nobody reads could fill and block the run
            proc = subprocess.Popen(
                [sys.executable, "apps/geo3k_grpo", *argv, lost, "node_lost"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
            )
            deadline = time.monotonic() + 300
            while _last_checkpoint(run) <= before:
                alive = proc.poll() is None and time.monotonic() < deadline
                assert alive, log.read_text()[-3000:]
                time.sleep(0.2)
            children = psutil.Process(third.pid).children(True)
            (raylet,) = [p for p in children if p.name() == "raylet"]
            raylet.kill()
            proc.wait(timeout=300)  # never hangs: detection, then --node-wait-s
    finally:
        _stop(third)
    return proc.returncode, log.read_text()


@pytest.fixture(scope="module")
def lost_nodes(cluster, sft, tmp_path_factory) -> dict:
    """One GRPO run from the SFT folder (trainer and engine on different nodes throughout):
    its engine's node is lost; resumed, its trainer's node is lost; resumed on node_a (trainer)
    and node_b (engine), it finishes one step later."""
    address, env, _ = cluster
    tmp = tmp_path_factory.mktemp("lost")
    run = tmp / "run"
    argv = ["--preset", "tiny", "--ray-address", address, "--output-dir", str(run)]
    argv += ["--load", str(sft / "hf"), "--no-colocate", "--eval-interval", "0"]
    argv += ["--num-rollout", "40", "--save-interval", "1", "--node-wait-s", "2"]
    argv += ["--rollout-batch-size", "4", "--global-batch-size", "32"]  # one small update
    out: dict = {"run": run}
    engine_lost = [*argv, "--trainer-resource", "node_a"]
    out["engine"] = _lose_node(address, env, engine_lost, "--rollout-resource", tmp / "e.log")
    trainer_lost = [*argv, "--resume", "--rollout-resource", "node_b"]
    out["trainer"] = _lose_node(address, env, trainer_lost, "--trainer-resource", tmp / "t.log")
    out["done"] = done = _rows(run)[-1]["step"]
    argv[argv.index("40")] = str(done + 1)
    argv += ["--resume", "--trainer-resource", "node_a", "--rollout-resource", "node_b"]
    out["resumed"], _ = _launch("geo3k_grpo", argv, env)
    return out


@pytest.mark.timeout(900)
def test_sft_and_grpo_run_across_two_nodes(sft, lost_nodes):
    assert _placed(sft) == {"trainer": [["node_b"]]}  # the node the driver is not on
    resumed, grpo = lost_nodes["resumed"], lost_nodes["run"]
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # the last run of the GRPO that started from the SFT folder
    assert _placed(grpo) == {"trainer": [["node_a"]], "engine": [["node_b"]]}
    rows = _rows(grpo)
    assert rows[-1]["step"] == lost_nodes["done"] + 1
    # the engine on node_b generated the last step with the weights the trainer on node_a
    # sent; each step's update crossed to another node (the engine never on the trainer's)
    assert all(r["time_sync_push_s"] > 0 for r in rows), rows


@pytest.mark.timeout(900)
def test_a_lost_node_ends_the_run_in_one_line_and_it_resumes(lost_nodes):
    """A third node holds the engine (then, resumed, the trainer); its raylet is killed once a
    checkpoint is saved. The run ends (an engine cannot be placed again: no other node has
    `node_lost`; a trainer rank is not restarted) with one line naming the actor, the lost
    node and the intact checkpoint; `--resume` with that actor on another node continues from
    that checkpoint."""
    for role, actor in (("engine", "rollout engine 0"), ("trainer", "trainer rank 0")):
        code, err = lost_nodes[role]
        text = " ".join(err.split())  # the stop line, as the log wraps it
        assert code == 1 and "Traceback" not in err, err[-3000:]
        assert actor in text and "was lost" in text and "is intact" in text, text[-2000:]
    assert "resumed from" in " ".join(lost_nodes["trainer"][1].split())
    resumed = lost_nodes["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in _rows(lost_nodes["run"])]
    assert steps == list(range(1, lost_nodes["done"] + 2)), steps
