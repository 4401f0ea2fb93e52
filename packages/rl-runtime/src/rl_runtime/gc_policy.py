"""Python's garbage collector on a schedule, in a trainer process.

A trainer process holds millions of long-lived Python objects (the model, compiled code and its
caches). CPython's automatic collections scan them now and then: a pause of tens of
milliseconds in the middle of a step, during which the GPU runs out of queued work and waits
for the host (docs/performance.md). As torchtitan's trainer does, :class:`PeriodicGC` turns
automatic collection off and collects between steps instead, every ``every`` steps. What is
alive after the first step (model, optimizer, compiled code) is frozen out of the collector's
view (``gc.freeze``), so those collections scan only what steps leave behind.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


class PeriodicGC:
    """Call :meth:`step` after each training step. ``every <= 0`` leaves Python's automatic
    collection as it is."""

    def __init__(self, every: int = 50) -> None:
        self.every = every
        self.steps = 0
        # a heap frozen before (a trainer's start-up, a test session) stays frozen at close
        self._frozen_before = gc.get_freeze_count() > 0
        if every > 0:
            gc.disable()

    def step(self) -> None:
        if self.every <= 0:
            return
        self.steps += 1
        if self.steps == 1 or self.steps % self.every == 0:
            start = time.perf_counter()
            gc.collect()
            if self.steps == 1:
                gc.freeze()
            log.debug("gc after step %d: %.1f ms", self.steps, 1e3 * (time.perf_counter() - start))

    def close(self) -> None:
        """Give collection back to Python (tests; a process that goes on without training), the
        heap frozen or not as it was found."""
        if self.every > 0:
            if not self._frozen_before:
                gc.unfreeze()
            gc.enable()
