"""A run stopped by a fault ends with its one-line message and exit code 1, no traceback.

The faults themselves are raised by real actors in test_faults.py; here `run` raises the same
error directly so the launchers' handling is checked in a second.
"""

from __future__ import annotations

import logging

import pytest

import geo3k_grpo.main as grpo_app
import geo3k_sft.main as sft_app
import rl_runtime.grpo_app
import rl_runtime.recipe
import rl_runtime.sft_app
from rl_runtime import WorkerDied
from rl_runtime.faults import Interrupted

#: The entry point each launcher's `main` runs: `run(cfg, recipe)`.
ENTRY = {grpo_app: rl_runtime.grpo_app, sft_app: rl_runtime.sft_app}

LINE = "trainer rank 1 died during train_step (ActorDiedError: ...); the last checkpoint is intact"


@pytest.mark.parametrize("app", [grpo_app, sft_app], ids=["grpo", "sft"])
def test_stopped_run_prints_one_line_and_exits_1(app, monkeypatch, caplog, tmp_path):
    def run(cfg, recipe):
        raise WorkerDied(LINE, [1])

    monkeypatch.setattr(ENTRY[app], "run", run)
    # the launcher's logging setup would replace caplog's handler
    monkeypatch.setattr(rl_runtime.recipe, "setup_logging", lambda level: None)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
        app.main(["--preset", "tiny", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [LINE]
    assert errors[0].exc_info is None  # no traceback


STOPPED = "interrupted: the step under way was abandoned; the last checkpoint x is intact"


def _in_loop():
    raise Interrupted(STOPPED)


def _twice():  # a second Ctrl-C during the shutdown the first one started
    try:
        _in_loop()
    except Interrupted:
        raise KeyboardInterrupt from None


def _outside():
    raise KeyboardInterrupt


@pytest.mark.parametrize("app", [grpo_app, sft_app], ids=["grpo", "sft"])
@pytest.mark.parametrize("run", [_in_loop, _twice, _outside], ids=["loop", "twice", "outside"])
def test_ctrl_c_prints_one_line_and_exits_130(app, run, monkeypatch, caplog, tmp_path):
    """Ctrl-C: 130 as a shell gives, and one warning line (in a loop: what to resume from, also
    when a second Ctrl-C cuts the shutdown short; while starting or finishing: that it was
    interrupted), never a traceback."""
    monkeypatch.setattr(ENTRY[app], "run", lambda cfg, recipe: run())
    # the launcher's logging setup would replace caplog's handler
    monkeypatch.setattr(rl_runtime.recipe, "setup_logging", lambda level: None)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
        app.main(["--preset", "tiny", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 130
    assert exit_.value.__cause__ is None and exit_.value.__suppress_context__
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].exc_info is None
    if run is _outside:
        assert said[0].getMessage().startswith("interrupted while starting or finishing")
    else:
        assert said[0].getMessage() == STOPPED
