"""A log that is not a terminal: one plain line per record in one layout (ours, Ray's own, its
workers'), no colour codes, no progress bars; a terminal keeps rich. The run's whole log, as
a launcher writes it into a file, is checked in tests/test_e2e_geo3k.py."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from rl_runtime import ray_logs
from rl_runtime.progress import no_progress_bars

#: ``2026-12-05 14:06:40 INFO <message>``
LAYOUT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S")

LONG = "step 1: rollout done in 8.92 s: 49,044 tokens, 5,499 tokens/s, 128 samples" + " x" * 40

SETUP = f"""
import logging
from rl_runtime.progress import setup_logging
setup_logging()
log = logging.getLogger("glimpse")
log.info({LONG!r})
log.info("placement plan:\\n  trainer rank 0 -> node a\\n  engine 0 -> node a")
log.warning("[bold]not markup[/bold] and no colour")
"""


def test_a_log_that_is_not_a_terminal_gets_one_plain_line_per_record():
    """Before: rich at 80 columns, wrapping a record over lines and padding each to the width
    (`step 1: rollout done in 8.92 s: 49,044 tokens, 5,499` / `tokens/s, 128 samples`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    out = subprocess.run(
        [sys.executable, "-c", SETUP], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 3, out.stderr
    assert all(LAYOUT.match(line) and line == line.rstrip() for line in lines), lines
    assert lines[0].endswith(f"INFO {LONG}")
    assert lines[1].endswith("INFO placement plan: trainer rank 0 -> node a engine 0 -> node a")
    assert lines[2].endswith("WARNING [bold]not markup[/bold] and no colour")
    assert "\x1b" not in out.stderr


def test_a_terminal_keeps_rich():
    from rich.logging import RichHandler

    from rl_runtime.progress import plain_logs, setup_logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging(plain=False)
        assert not plain_logs() and isinstance(root.handlers[0], RichHandler)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture
def ray_logger():
    """The `ray` logger as Ray sets it up, put back after the test."""
    import ray  # noqa: F401  (sets up the `ray` logger)

    logger = logging.getLogger("ray")
    handlers, propagate = list(logger.handlers), logger.propagate
    yield logger
    logger.handlers[:], logger.propagate = handlers, propagate


def test_ray_records_and_worker_lines_in_the_same_layout(ray_logger, monkeypatch, caplog):
    """Ray's own records reach the root logger (before: Ray's handler, its own layout), and a
    worker's lines one record each, at the worker's level, prefixed as Ray prefixes them,
    without the colour codes (before: `\\x1b[36m(TrainWorker pid=1052)\\x1b[0m INFO ...`)."""
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    ray_logs.route_ray_logs()
    assert ray_logger.propagate and not ray_logger.handlers
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    with caplog.at_level(logging.INFO):
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        ray_logs.log_worker_lines(
            {
                "pid": 1052,
                "actor_name": "TrainWorker",
                "ip": "10.0.0.2",
                "localhost": "10.0.0.1",
                "is_err": True,
                "lines": [
                    "INFO glimpse.startup: fsdp trainer rank 0: process group ...",
                    "ERROR glimpse.progress: rank 0 out of memory",
                    "Traceback (most recent call last):",
                ],
            }
        )
    got = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    who = "(TrainWorker pid=1052, ip=10.0.0.2) "
    assert got == [
        ("ray._private.worker", "INFO", "Started a local Ray instance."),
        (
            "glimpse.workers",
            "INFO",
            f"{who}glimpse.startup: fsdp trainer rank 0: process group ...",
        ),
        ("glimpse.workers", "ERROR", f"{who}glimpse.progress: rank 0 out of memory"),
        ("glimpse.workers", "WARNING", f"{who}Traceback (most recent call last):"),
    ]


def test_a_local_rays_token_notice_is_quiet_and_its_warning_without_one_is_not(caplog):
    """Ray turns token authentication on for a new local cluster and says "Set
    RAY_AUTH_MODE=disabled to opt out" on every run: left out (the authentication stays on).
    Its warning that a cluster runs without authentication still shows."""
    from ray._private.authentication import authentication_token_setup as setup

    with caplog.at_level(logging.WARNING), ray_logs.quiet_token_notice():
        setup._warn_token_auth_enabled()
        setup._warn_token_auth_disabled()
    assert [r.getMessage()[:51] for r in caplog.records] == [
        "Token authentication is disabled for this Ray clust"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        setup._warn_token_auth_enabled()  # outside a local start: as Ray says it
    assert caplog.records[0].getMessage().startswith(ray_logs.TOKEN_NOTICE)


def test_no_progress_bars_here_nor_in_the_processes_started_after(monkeypatch):
    """transformers' "Loading weights" bars (in the trainer and engine workers) and the hub's:
    a Ray worker inherits the environment of the driver that started Ray."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    try:
        no_progress_bars()
        assert are_progress_bars_disabled()
        bar = "from tqdm import tqdm\nfor _ in tqdm(range(3), desc='Loading weights'): pass"
        out = subprocess.run([sys.executable, "-c", bar], capture_output=True, text=True)
        assert out.returncode == 0 and out.stderr == "", out.stderr
    finally:
        enable_progress_bars()
