"""Ctrl-C counted once (`rl_runtime.interrupts`): the SIGINTs are real, sent to this process;
what follows the first (a repeat, a failure it caused) ends as an interrupt, never as a fault."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

from rl_runtime import CheckpointManager, WorkerDied, interrupts
from rl_runtime.cli import user_errors
from rl_runtime.faults import Interrupted, stop_with_checkpoint_note
from rl_runtime.interrupts import interrupted, shielded, watch_sigint
from rl_runtime.progress import phase


def ctrl_c() -> None:
    """A SIGINT to this process; Python runs its handler before the next bytecode."""
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(autouse=True)
def foreground():
    """Python's own SIGINT handler, as a launcher run from a terminal has: a suite started as a
    shell's background job inherits SIGINT ignored, which `watch_sigint` leaves as it is (the
    last test), and every Ctrl-C above would be dropped (all failed so, 2026-12-07)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_ctrl_c_raises_and_the_same_one_again_is_dropped():
    with watch_sigint():
        assert not interrupted()
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        assert interrupted()
        ctrl_c()  # delivered twice (the group's and the one `uv run` passes on): no raise
    assert not interrupted()  # the state is the block's
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_later_ctrl_c_does_not_cut_a_shielded_shutdown_short(monkeypatch, caplog):
    monkeypatch.setattr(interrupts, "REPEAT_S", 0.0)  # every repeat is a new Ctrl-C
    closed = []
    with watch_sigint(), caplog.at_level(logging.WARNING):
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        with shielded():
            ctrl_c()
            closed.append("ray")
        assert closed == ["ray"]
        assert caplog.messages == ["Ctrl-C again: still shutting down (a few seconds)"]
        with pytest.raises(KeyboardInterrupt):  # outside a shutdown the user insists
            ctrl_c()


def test_cluster_close_runs_to_its_end_through_a_second_ctrl_c(monkeypatch):
    """Before: the second SIGINT raised inside the first group's shutdown, the placement and
    Ray were left up, and a Ray cut short mid-shutdown could end the process with status 1."""
    from rl_runtime.cluster import Cluster

    monkeypatch.setattr(interrupts, "REPEAT_S", 0.0)
    done: list[str] = []

    class Group:
        def shutdown(self) -> None:
            ctrl_c()
            done.append("group")

    class Placement:
        def remove(self) -> None:
            done.append("placement")

    cluster = object.__new__(Cluster)
    cluster.groups, cluster.placement, cluster.owns_ray = [Group(), Group()], Placement(), False
    with watch_sigint():
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        cluster.close()
    assert done == ["group", "group", "placement"]


def test_a_phase_that_fails_after_ctrl_c_says_interrupted(caplog):
    """Ctrl-C logged `step 5: old log-probs failed after 0.811 s` when the call ended in
    another error than KeyboardInterrupt (an actor that died of the same signal)."""
    with watch_sigint(), caplog.at_level(logging.INFO):
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        with pytest.raises(RuntimeError), phase("step 5: old log-probs"):
            raise RuntimeError("the actor died")
    assert re.fullmatch(
        r"step 5: old log-probs interrupted after [\d.]+ s", caplog.records[-1].getMessage()
    )


def test_a_fault_after_ctrl_c_is_the_interrupt_in_the_loop(tmp_path):
    checkpoints = CheckpointManager(tmp_path / "checkpoints")
    checkpoints.save(3, {}, lambda path: None)
    with watch_sigint():
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        with pytest.raises(Interrupted) as err, stop_with_checkpoint_note(checkpoints):
            raise WorkerDied("trainer rank 0 died during train_step", [0])
    assert str(err.value) == (
        "interrupted: the step under way was abandoned; the last checkpoint "
        f"{tmp_path / 'checkpoints' / 'step_000003'} is intact (--resume continues from it)"
    )


@pytest.mark.parametrize("error", [WorkerDied("trainer rank 0 died", [0]), OSError("pipe")])
def test_a_failure_after_ctrl_c_exits_130_not_1(error, caplog):
    """Before: a fault raised after Ctrl-C (a RunStopped: exit 1; any other error: a
    traceback, exit 1)."""
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(SystemExit) as exit_,
        user_errors("geo3k_sft", []),
    ):
        try:
            ctrl_c()
        except KeyboardInterrupt:
            raise error from None
    assert exit_.value.code == 130
    assert [r.getMessage()[:43] for r in caplog.records] == [
        "interrupted while starting or finishing (no"
    ]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_background_job_keeps_ctrl_c_ignored():
    """A shell's background job (`cmd &`) starts with SIGINT ignored: the terminal's Ctrl-C is
    meant for the foreground job, so watch_sigint takes none and restores nothing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with watch_sigint():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        ctrl_c()  # dropped by the kernel: no raise
        assert not interrupted()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
