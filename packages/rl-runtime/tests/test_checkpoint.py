"""Atomic checkpoints: an interrupted save leaves the previous one usable."""

import pytest

from rl_runtime.checkpoint import CheckpointManager


def _writer(payload: str):
    def write(path):
        (path / "weights.txt").write_text(payload)

    return write


def test_save_latest_and_prune(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        mgr.save(step, {"sampler": {"cursor": step}}, _writer(f"w{step}"))
    steps = [s for s, _ in mgr.complete()]
    assert steps == [20, 30]
    step, path = mgr.latest()
    assert step == 30 and mgr.load_state(path)["sampler"]["cursor"] == 30
    assert (path / "trainer" / "weights.txt").read_text() == "w30"


def test_crash_during_save_keeps_previous(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(10, {"x": 1}, _writer("good"))

    def crash(path):
        (path / "weights.txt").write_text("half")
        raise KeyboardInterrupt  # the process dies mid-save

    with pytest.raises(KeyboardInterrupt):
        mgr.save(20, {"x": 2}, crash)
    step, path = mgr.latest()
    assert step == 10 and (path / "trainer" / "weights.txt").read_text() == "good"
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    mgr.clean_partial()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_resave_same_step_replaces(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, {}, _writer("a"))
    mgr.save(5, {}, _writer("b"))
    _, path = mgr.latest()
    assert (path / "trainer" / "weights.txt").read_text() == "b"
    assert [s for s, _ in mgr.complete()] == [5]
