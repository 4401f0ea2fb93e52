"""A trainer rank's start-up, phase by phase, so that one that hangs names where.

Building a trainer joins process groups, builds and loads the model, compiles and sets up the
optimizer: minutes for a large model, and a collective that waits for a peer, a kernel that
compiles or a download looks the same from outside. Each phase is logged when it begins and,
with its time, when it ends (INFO, on the ``glimpse.startup`` logger, which rl-runtime's
workers show whatever their level), so the last line of a stuck rank is its phase.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: a name of its own (not the module's): the runtime shows it at INFO in every worker
logger = logging.getLogger("glimpse.startup")


class StartupLog:
    """``with log.phase("model"): ...`` logs the phase's start and its seconds; ``total_s``
    the time since construction."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        logger.info("%s: %s ...", self.who, name)
        begin = time.perf_counter()
        yield
        self.phases[name] = seconds = time.perf_counter() - begin
        logger.info("%s: %s done in %.1f s", self.who, name, seconds)

    @property
    def total_s(self) -> float:
        return time.perf_counter() - self.start

    def done(self) -> None:
        """The closing line: every phase's seconds and the total."""
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases.items())
        logger.info("%s: ready in %.1f s (%s)", self.who, self.total_s, parts)
