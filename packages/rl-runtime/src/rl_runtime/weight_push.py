"""Weight sync as rl-runtime sees it: the protocol, the links to the engines, and Ray's object store.

Trainer rank 0 builds a :class:`~rl_runtime.protocols.WeightTransport` with the factory the app
chose (:class:`~rl_runtime.protocols.TransportFactory`) and feeds it the actor's HF-named
buckets; the other ranks iterate the same buckets (gathering full tensors is collective) and send
nothing. rl-runtime owns one transport, Ray's object store (the default: any placement, any
device); the CUDA IPC and NCCL transports come from the rollout package and reach the engines
through :class:`RemoteEngine`, whose ``submit`` runs their engine-side half in the engine's actor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import ray

from rl_runtime.protocols import NamedTensors


class RemoteEngine:
    """An :class:`~rl_runtime.protocols.EngineLink` over an engine actor (``EngineWorker``)."""

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
