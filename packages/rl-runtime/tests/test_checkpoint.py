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


def test_keep_counts_newest_and_zero_keeps_all(tmp_path):
    """`keep_last` N keeps the N newest (never the one just saved is lost); 0 keeps all;
    a negative count is refused instead of deleting every checkpoint."""
    one = CheckpointManager(tmp_path / "one", keep_last=1)
    every = CheckpointManager(tmp_path / "all", keep_last=0)
    for step in (1, 2, 3):
        one.save(step, {}, _writer(str(step)))
        every.save(step, {}, _writer(str(step)))
        assert one.latest()[0] == step
    assert [s for s, _ in one.complete()] == [3]
    assert [s for s, _ in every.complete()] == [1, 2, 3]
    with pytest.raises(ValueError, match="keep_last must be >= 0"):
        CheckpointManager(tmp_path / "neg", keep_last=-1)


def test_resume_never_replaces_metrics_of_a_run_without_checkpoints(tmp_path):
    """--resume with no checkpoint: fine in an empty folder (step 0), refused when metrics.jsonl
    holds rows a fresh start would replace; the rows stay as they were."""
    from rl_runtime import RunLogger
    from rl_runtime.checkpoint import ResumeError, resume_step

    mgr = CheckpointManager(tmp_path / "checkpoints")
    assert resume_step(mgr, tmp_path) == 0
    logger = RunLogger(tmp_path)
    for step in (1, 2, 3):
        logger.log({"step": step, "reward_mean": 0.1 * step})
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ResumeError, match=r"3 rows \(up to step 3\).*without --resume") as err:
        resume_step(mgr, tmp_path)
    assert err.value.code != 0 and "\n" not in err.value.message
    assert (tmp_path / "metrics.jsonl").read_text() == before
    mgr.save(2, {}, _writer("w2"))
    assert resume_step(mgr, tmp_path) == 2


def test_disk_full_mid_save_removes_the_partial_save_and_keeps_the_previous(tmp_path):
    import errno
    import os

    from rl_runtime import CheckpointFailed

    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(10, {"x": 1}, _writer("good"))

    def disk_full(path):
        with open(path / "shard.bin", "wb") as f:
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / "shard.bin"))

    with pytest.raises(CheckpointFailed) as err:
        mgr.save(20, {"x": 2}, disk_full)
    message = str(err.value)
    assert message.startswith("checkpoint of step 20 not saved (OSError: [Errno 28] No space")
    assert f"the last checkpoint {tmp_path / 'step_000010'} is intact" in message
    assert [p.name for p in tmp_path.iterdir()] == ["step_000010"]  # the space is given back
    step, path = mgr.latest()
    assert step == 10 and (path / "trainer" / "weights.txt").read_text() == "good"
