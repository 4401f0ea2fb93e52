"""A trainer rank's start-up phases are logged with their times, so a hang names its phase."""

import logging

import pytest

from trainer_core.startup import StartupLog


def test_each_phase_is_logged_when_it_begins_and_with_its_time_when_it_ends(caplog):
    log = StartupLog("megatron trainer rank 0")
    with caplog.at_level(logging.INFO, logger="glimpse.startup"):
        with log.phase("process groups"):
            pass
        with pytest.raises(RuntimeError), log.phase("model"):
            raise RuntimeError("stuck")  # the begun phase is the last line
        log.done()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "megatron trainer rank 0: process groups ..."
    assert lines[1].startswith("megatron trainer rank 0: process groups done in ")
    assert lines[2] == "megatron trainer rank 0: model ..."
    assert "model done" not in " ".join(lines)
    assert list(log.phases) == ["process groups"]
    assert lines[-1].startswith("megatron trainer rank 0: ready in ")
