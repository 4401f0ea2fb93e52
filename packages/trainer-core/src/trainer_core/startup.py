"""A trainer rank's start-up, phase by phase, so that one that hangs names where.

Building a trainer joins process groups, builds and loads the model, compiles and sets up the
optimizer: minutes for a large model, and a collective that waits for a peer, a kernel that
compiles or a download looks the same from outside. Each phase is logged when it begins and,
with its time, when it ends (INFO, on the ``glimpse.startup`` logger, which rl-runtime's
workers show whatever their level), so the last line of a stuck rank is its phase.

Each phase's line also gives the process's resident host memory once what the phase dropped
is really gone: Python's cyclic garbage collected, then the C heap's free pages given back to
the system (glibc's ``malloc_trim``). Loading a checkpoint on the host in float32 and moving it
to the GPU leaves the freed blocks in the heap: on the H200 (2026-12-04) the 8B FSDP trainer
held 15 GiB more after start-up than its optimizer state on the host, and Ray's memory monitor
killed the run when the engine parked its weights. Unreachable cycles hold more: megatron-core
builds a first HybridDeviceOptimizer over the whole model and drops it in a cycle (its hooks
point back at it), with float32 copies of the offloaded part (23 GiB for the 8B at 70 %); a
random-init model built through transformers can stay reachable from a cycle of frames. The
trainer process turns automatic collection off once built (``rl_runtime.gc_policy``), so without
a collection here they would stay through the first train step.

What the process holds when start-up begins (torch, transformers, megatron-core, Ray: half a
million objects that live as long as it does) is collected once and then frozen out of the
collector's walk (``gc.freeze``), where nothing froze it before: each phase's collection then
walks only what start-up made, not 0.27 s of imports four or five times a rank.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
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
        if gc.get_freeze_count() == 0:  # once a process (a test session froze its own)
            gc.collect()
            gc.freeze()  # what lives before start-up lives on: out of each phase's collection

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        logger.info("%s: %s ...", self.who, name)
        begin = time.perf_counter()
        yield
        self.phases[name] = seconds = time.perf_counter() - begin
        gc.collect()
        trim_host_heap()
        rss = resident_gib()
        host = "" if rss is None else f", {rss:.1f} GiB host memory resident"
        logger.info("%s: %s done in %.1f s%s", self.who, name, seconds, host)

    @property
    def total_s(self) -> float:
        return time.perf_counter() - self.start

    def done(self) -> None:
        """The closing line: every phase's seconds and the total."""
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases.items())
        logger.info("%s: ready in %.1f s (%s)", self.who, self.total_s, parts)


def trim_host_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``); False where
    the C library has none (macOS, musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    return bool(trim(0))


def resident_gib() -> float | None:
    """This process's resident host memory now, in GiB (``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
