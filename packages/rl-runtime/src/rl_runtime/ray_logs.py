"""Ray's output in the run's log. Ray prints its own records (``2026-12-05 14:06:38,866\tINFO
worker.py:2038 -- Started a local Ray instance.``) through a handler of its own, and each line a
worker writes as ``\\x1b[36m(TrainWorker pid=1052)\\x1b[0m <line>`` on the driver's stdout or
stderr. Where the log is not a terminal (`rl_runtime.progress.setup_logging`), both go through
`logging` instead, in the run's one layout and without colour codes
(`route_ray_logs`, before `ray.init`; `route_worker_lines`, after it):
``2026-12-05 14:06:40 INFO (TrainWorker pid=1052) glimpse.startup: fsdp trainer rank 0: ...``.

A local Ray's notice that it turned token authentication on ("Set RAY_AUTH_MODE=disabled to
opt out") is left out (`quiet_token_notice`): the authentication stays on, as Ray chose; only
the advice to turn it off is not repeated on every run. Joining a cluster is not touched.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

#: the logger worker lines are re-logged through; every line passes (each worker filters its own)
WORKERS = logging.getLogger("glimpse.workers")
WORKERS.setLevel(logging.DEBUG)

#: a worker line as Ray prints it: its prefix, then a logging record's level where it is one
#: (`actor_group._configure_worker_logging`)
_LINE = re.compile(
    r"^(?P<who>\([^)]*\) )?(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) )?(?P<text>.*)$"
)

#: the name Ray gives its driver-side printer of worker lines (``ray._private.worker.connect``)
_RAY_PRINTER = "ray_print_logs"

#: the start of the warning a new local Ray logs when it turns token authentication on
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


def route_ray_logs() -> None:
    """Ray's own records (the ``ray`` logger) to the root logger's handlers, and no colour
    codes on what Ray still prints itself (its last deduplicated worker lines at shutdown)."""
    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's switch, read as it prints


def route_worker_lines() -> bool:
    """Worker lines through `WORKERS` instead of Ray's printer (after ``ray.init``); whether
    that was possible (Ray keeps the printer in a private module: where it is not found, Ray
    prints them itself, without colour codes after `route_ray_logs`)."""
    from ray._private import worker as ray_worker

    used = ("print_worker_logs", "stderr_deduplicator", "stdout_deduplicator")
    dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
    if dispatcher is None or not all(hasattr(ray_worker, name) for name in used):
        return False
    if not any(name == _RAY_PRINTER for name, _ in getattr(dispatcher, "handlers", [])):
        return False  # log_to_driver=False, or a Ray that names it otherwise
    dispatcher.remove_handler(_RAY_PRINTER)
    dispatcher.add_handler(_RAY_PRINTER, log_worker_lines)  # Ray removes it by this name
    return True


def log_worker_lines(data: dict[str, Any]) -> None:
    """One batch of lines from one worker (Ray's dict: ``pid``, ``lines``, ``is_err``, ...),
    deduplicated and written by Ray's own printer (its prefix, its filter of the autoscaler's
    lines) into `_LogLines`: each line one record."""
    from ray._private.worker import print_worker_logs, stderr_deduplicator, stdout_deduplicator

    err = bool(data.get("is_err"))
    if data.get("pid") == "autoscaler":
        batches = [data]
    else:
        batches = (stderr_deduplicator if err else stdout_deduplicator).deduplicate(data)
    sink = _LogLines(logging.WARNING if err else logging.INFO)
    for batch in batches:
        print_worker_logs(batch, sink)


class _LogLines:
    """A file for Ray's printer: each line it writes, ``(TrainWorker pid=1052) INFO name: text``,
    becomes a record of `WORKERS` at the line's level (``default`` where it names none, as a
    print or a traceback), ``(TrainWorker pid=1052) name: text``."""

    def __init__(self, default: int) -> None:
        self.default = default
        self.pending = ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.log(line)
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.log(self.pending)
            self.pending = ""

    def log(self, line: str) -> None:
        found = _LINE.match(line)
        if found is None or found["level"] is None:
            WORKERS.log(self.default, "%s", line)
        else:
            level = logging.getLevelName(found["level"])
            WORKERS.log(level, "%s%s", found["who"] or "", found["text"])


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TOKEN_NOTICE)


@contextmanager
def quiet_token_notice() -> Iterator[None]:
    """Leave out a new local Ray's notice that token authentication is on (see the module)."""
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray without token authentication
        yield
        return
    notice, drop = logging.getLogger(setup.__name__), _DropTokenNotice()
    notice.addFilter(drop)
    try:
        yield
    finally:
        notice.removeFilter(drop)
