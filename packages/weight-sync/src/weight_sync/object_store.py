"""Weight sync through Ray's object store: the transport that serves every layout.

Each bucket is copied to host memory, put once in Ray's object store and loaded by every engine
actor (its ``update_weights``). It is rl-runtime's default (any placement, any device) and the
fallback when a faster transport cannot serve a layout. :class:`RemoteEngine` is the
:class:`~weight_sync.protocol.EngineLink` over an engine actor: the other transports run their
engine-side half through its ``submit``. The only module of this package that imports Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

try:
    import ray
except ImportError as err:  # pragma: no cover - rl-runtime, this transport's user, installs ray
    raise ImportError(
        "the object-store weight transport needs Ray: pip install 'weight-sync[ray]'"
    ) from err

from weight_sync.protocol import NamedTensors


class RemoteEngine:
    """An :class:`~weight_sync.protocol.EngineLink` over an engine actor (rl-runtime's ``EngineWorker``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        # a dead engine's future raises Ray's RayActorError, which `faults.gather` reports as
        # "an actor it called died"
        return self.handle.run.remote(fn, *args).future()


class ObjectStoreTransport:
    """Each bucket moved to host memory, put once in Ray's object store and loaded by every
    engine (``update_weights``); one bucket in flight while the next is gathered."""

    def __init__(self, engines: Sequence[RemoteEngine]) -> None:
        self.engines = list(engines)

    def send(self, buckets: Iterable[NamedTensors]) -> int:
        sent = 0
        pending: list[Any] = []
        for bucket in buckets:
            cpu_bucket = [(name, t.detach().to("cpu")) for name, t in bucket]
            ref = ray.put(cpu_bucket)
            ray.get(pending)
            pending = [e.handle.update_weights.remote(ref) for e in self.engines]
            sent += len(cpu_bucket)
        ray.get(pending)
        return sent

    def close(self) -> None:
        """Nothing held."""


@dataclass(frozen=True)
class ObjectStore:
    """The factory of :class:`ObjectStoreTransport` (rl-runtime's default transport)."""

    restartable: ClassVar[bool] = True

    def __call__(self, engines: Sequence[RemoteEngine]) -> ObjectStoreTransport:
        return ObjectStoreTransport(engines)


object_store = ObjectStore()
