"""Removes a local Ray's processes once the driver that started them is gone, however it died.

Ray ties its GCS and raylet to the driver (they die with it, even on SIGKILL), but not the
raylet's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`), which linger for minutes. The
driver starts this file as a separate process (its own session, so a kill of the driver's
process group spares it) holding the read end of a pipe. The driver's death, or its
`ray.shutdown`, closes the pipe; this process then ends every process with a file open in the
Ray session's folder (every Ray process has its logs there), first with SIGTERM, then SIGKILL.

Run as a file (`python ray_reaper.py SESSION_DIR`), not as part of the package: it imports
only the standard library, so it starts in milliseconds and costs little memory.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = 3.0
"""How long processes get to exit after SIGTERM before they are killed."""


def session_pids(session_dir: str, spare: frozenset[int] = frozenset()) -> set[int]:
    """Processes (of this user, but for this one and `spare`) that have a file open under
    `session_dir` (Linux /proc)."""
    prefix = session_dir.rstrip("/") + "/"
    found = set()
    spare = spare | {os.getpid()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spare:
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix):
                found.add(int(entry.name))
                break
    return found


def descendants(pid: int) -> set[int]:
    """Every process below `pid` in the process tree (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the name may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_all(pids: set[int]) -> None:
    """SIGKILL each of `pids` that still exists."""
    _signal_all(pids, signal.SIGKILL)


def _signal_all(pids: set[int], sig: signal.Signals) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
            alive.add(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def reap(
    session_dir: str, spare: frozenset[int] = frozenset(), grace_s: float = GRACE_S
) -> set[int]:
    """End the session's processes (never those in `spare`); return the pids signalled."""
    pids = session_pids(session_dir, spare)
    alive = _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive &= session_pids(session_dir, spare)
    _signal_all(alive, signal.SIGKILL)
    return pids


def main(argv: list[str]) -> None:
    """`ray_reaper.py SESSION_DIR DRIVER_PID`: wait for EOF on stdin, then reap (sparing the
    driver, which closes the pipe itself after a normal `ray.shutdown`)."""
    session_dir, driver = argv
    sys.stdin.buffer.read()  # returns at EOF: the driver closed the pipe or died
    if os.path.isdir(session_dir):
        reap(session_dir, frozenset({int(driver)}))


if __name__ == "__main__":
    main(sys.argv[1:])
