"""The retry logic of `RestartingRollout` and the stop messages, without Ray (the real actors
die in tests/test_faults.py)."""

from __future__ import annotations

import pytest

from rl_runtime import CheckpointManager, RunStopped, WorkerDied
from rl_runtime.faults import Interrupted, RestartingRollout, stop_with_checkpoint_note


class Group:
    """A rollout group whose engine 1 dies in the first `deaths` calls of `generate`."""

    def __init__(self, deaths: int, engines_restartable: bool = True) -> None:
        self.deaths, self.engines_restartable = deaths, engines_restartable
        self.restarted: list[list[int]] = []

    def generate(self, prompts, **kwargs):
        if self.deaths:
            self.deaths -= 1
            raise WorkerDied("rollout engine 1 died during generate (ActorDiedError: gone)", [1])
        return [[p] for p in prompts]

    def restart(self, indices):
        self.restarted.append(list(indices))


def test_dead_engine_is_restarted_resynced_and_the_call_repeated():
    group, synced = Group(deaths=2), []
    rollout = RestartingRollout(group, lambda: synced.append(1), retries=2)
    assert rollout.generate(["a", "b"], n=1) == [["a"], ["b"]]
    assert group.restarted == [[1], [1]] and len(synced) == 2 and rollout.restarts == 2


def test_retries_are_bounded():
    rollout = RestartingRollout(Group(deaths=5), lambda: None, retries=1)
    with pytest.raises(RunStopped, match=r"engine 1 died .*; gave up after 1 restart"):
        rollout.generate(["a"], n=1)


def test_engines_on_the_nccl_transport_are_not_restarted():
    group = Group(deaths=1, engines_restartable=False)
    with pytest.raises(RunStopped, match="engines on GPUs of their own are not restarted"):
        RestartingRollout(group, lambda: None, retries=2).generate(["a"], n=1)
    assert group.restarted == []


def test_stop_message_names_the_kept_checkpoint(tmp_path):
    checkpoints = CheckpointManager(tmp_path / "checkpoints")
    with (
        pytest.raises(RunStopped, match=r"no checkpoint was saved yet$"),
        stop_with_checkpoint_note(checkpoints),
    ):
        raise RunStopped("trainer rank 1 died")
    # a finished SFT warm-up beside it is what the same command starts from again
    (tmp_path / "sft_warmup" / "hf").mkdir(parents=True)
    (tmp_path / "sft_warmup" / "hf" / "config.json").write_text("{}")
    with (
        pytest.raises(RunStopped, match=r"warm-up .*sft_warmup is kept and reused"),
        stop_with_checkpoint_note(checkpoints),
    ):
        raise RunStopped("trainer rank 1 died")
    tmp_path = tmp_path / "checkpoints"
    checkpoints.save(10, {}, lambda path: None)
    with pytest.raises(WorkerDied) as err, stop_with_checkpoint_note(checkpoints):
        raise WorkerDied("trainer rank 1 died during train_step", [1])
    assert str(err.value) == (
        f"trainer rank 1 died during train_step; the last checkpoint {tmp_path / 'step_000010'}"
        " is intact (--resume continues from it)"
    )


def test_ctrl_c_becomes_one_line_naming_what_resume_continues_from(tmp_path):
    """Ctrl-C in a loop: the step under way is abandoned, and the line says which checkpoint
    `--resume` continues from, or that there is none and the same command starts over."""
    checkpoints = CheckpointManager(tmp_path / "checkpoints")
    with pytest.raises(Interrupted) as err, stop_with_checkpoint_note(checkpoints):
        raise KeyboardInterrupt
    assert str(err.value) == (
        "interrupted: the step under way was abandoned; no checkpoint was saved yet; the same "
        "command without --resume starts over"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no traceback chain
    checkpoints.save(3, {}, lambda path: None)
    with pytest.raises(Interrupted) as err, stop_with_checkpoint_note(checkpoints):
        raise KeyboardInterrupt
    assert str(err.value) == (
        "interrupted: the step under way was abandoned; the last checkpoint "
        f"{tmp_path / 'checkpoints' / 'step_000003'} is intact (--resume continues from it)"
    )
