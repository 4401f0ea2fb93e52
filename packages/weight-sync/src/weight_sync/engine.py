"""Weight sync to engines in the trainer's own process: the buckets handed to ``update_weights``.

Used where the trainer holds the engine object itself (a single-process run, a benchmark, the
tests): nothing is copied beyond what the engine's ``update_weights`` does (the transformers
engine copies in place; SGLang in-process takes CUDA IPC handles for CUDA tensors). Also the
weight-update session every SGLang receiving side needs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from weight_sync.protocol import NamedTensors

logger = logging.getLogger(__name__)


class EngineTransport:
    """Buckets through the engines' own ``update_weights``; each engine's update is one
    weight-update session, opened and closed by the engine."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    def send(self, buckets: Iterable[NamedTensors]) -> int:
        buckets = list(buckets)
        for engine in self.engines:
            engine.update_weights(buckets)
        return sum(len(b) for b in buckets)

    def close(self) -> None:
        """Nothing held."""


@contextmanager
def weight_update_session(engine: Any) -> Iterator[None]:
    """``begin_weight_update`` ... ``end_weight_update`` around a weight update: sglang 0.5.23
    refuses ``update_weights_from_tensor`` / ``_from_distributed`` outside one
    (``managers/scheduler_components/weight_updater.py``). The session is closed even when a
    bucket fails, so the next update can open one; the bucket's error is the one raised."""
    engine.begin_weight_update()
    try:
        yield
    except BaseException:
        try:
            engine.end_weight_update()
        except Exception:  # the first error is the one worth reporting
            logger.warning("end_weight_update after a failed update also failed", exc_info=True)
        raise
    engine.end_weight_update()
