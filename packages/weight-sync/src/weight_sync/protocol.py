"""The one shape every weight transport has, and what a transport sees of an engine.

Trainer rank 0 builds a :class:`WeightTransport` with a :class:`TransportFactory` (the launcher
picks it for the layout) and feeds it HF-named buckets (:func:`weight_sync.iter_weight_buckets`);
the engines are reached through :class:`EngineLink` (in a Ray run
:class:`~weight_sync.object_store.RemoteEngine`). Defined here once, so rl-runtime's loop and
the rollout package speak the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

#: One bucket: ``(HF name, tensor)`` pairs, in order.
NamedTensors = list[tuple[str, Tensor]]


@runtime_checkable
class WeightTransport(Protocol):
    """How trainer rank 0 hands HF-named weight buckets to the rollout engines. Built in rank
    0's process by a :class:`TransportFactory`; it is fed the actor's buckets on the device
    where the weights live and moves them itself (the caller moves nothing)."""

    def send(self, buckets: Iterable[NamedTensors]) -> int:
        """Deliver every bucket to every engine; returns the number of tensors sent. Returns
        only once the engines hold the weights."""
        ...

    def close(self) -> None: ...


class EngineLink(Protocol):
    """One rollout engine as the transport in the trainer's process sees it."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(engine, *args)`` in the engine's process (calls run in submission order);
        ``fn`` is the engine-side half of a transport, a module-level function."""
        ...


class TransportFactory(Protocol):
    """Picklable; called in trainer rank 0's process with one link per engine, again when an
    engine was replaced. ``restartable``: whether a replaced engine can join (a broadcast
    group, set up once, cannot take a new member)."""

    restartable: bool

    def __call__(self, engines: Sequence[EngineLink]) -> WeightTransport: ...
