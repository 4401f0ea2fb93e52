"""Ctrl-C, counted once. The launchers (`rl_runtime.cli.user_errors`) install `watch_sigint`:
the first SIGINT raises KeyboardInterrupt where the launcher is, as Python's own handler does;
the same Ctrl-C delivered again within `REPEAT_S` (a terminal signals the whole foreground
group, and `uv run` without a terminal passes on the one its group got: two SIGINTs) is
dropped, and one during a `shielded` block (Ray's shutdown) is noted, not raised, so the
shutdown the first one started runs to its end. A later Ctrl-C outside such a block still
raises: the user insists.

`interrupted()` says whether a Ctrl-C came: a failure that follows it (an actor or a pool
worker that died of the same signal, a call cut short) is the interrupt's, and is reported as
such (exit 130, "interrupted"), not as a fault of the run.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

#: seconds after the first Ctrl-C within which another SIGINT is the same one delivered twice
REPEAT_S = 2.0

_first: float | None = None  # time.monotonic() of the first Ctrl-C since `watch_sigint`
_shielded = 0  # depth of `shielded` blocks under way


def interrupted() -> bool:
    """Whether Ctrl-C came since the launcher installed `watch_sigint`."""
    return _first is not None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _first
    now = time.monotonic()
    if _first is None:
        _first = now
        raise KeyboardInterrupt
    if now - _first < REPEAT_S:
        return  # the same Ctrl-C, delivered again
    if _shielded:
        log.warning("Ctrl-C again: still shutting down (a few seconds)")
        return
    raise KeyboardInterrupt


@contextmanager
def watch_sigint() -> Iterator[None]:
    """Count Ctrl-C as above while the block runs (in the main thread; elsewhere Python's
    handler is left as it is); the previous handler and state come back after it."""
    global _first
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:  # a shell's background job: Ctrl-C is not ours to take
        yield
        return
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _first = None


@contextmanager
def shielded() -> Iterator[None]:
    """A block a repeated Ctrl-C does not cut short (shutting Ray down after the first)."""
    global _shielded
    _shielded += 1
    try:
        yield
    finally:
        _shielded -= 1
