"""A run stopped by a fault ends with its one-line message and exit code 1, no traceback.

The faults themselves are raised by real actors in test_faults.py; here `run` raises the same
error directly so the launchers' handling is checked in a second.
"""

from __future__ import annotations

import logging

import pytest

import geo3k_grpo.main as grpo_app
import geo3k_sft.main as sft_app
from rl_runtime import WorkerDied

LINE = "trainer rank 1 died during train_step (ActorDiedError: ...); the last checkpoint is intact"


@pytest.mark.parametrize("app", [grpo_app, sft_app], ids=["grpo", "sft"])
def test_stopped_run_prints_one_line_and_exits_1(app, monkeypatch, caplog, tmp_path):
    def run(cfg):
        raise WorkerDied(LINE, [1])

    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(app, "setup_logging", lambda level: None)  # keep caplog's handler
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
        app.main(["--preset", "tiny", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [LINE]
    assert errors[0].exc_info is None  # no traceback
