"""How a trainer rank drives the transport protocol, without Ray (the Ray path runs end to end in
tests/test_ray_groups.py): which rank sends, on which device the buckets come, when a transport
is kept or built again. (That rl-runtime imports none of the backends it drives is
tests/test_boundaries.py's.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

from rl_runtime import TrainWorker
from weight_sync import WeightTransport


class Actor:
    """The weights-out part of a trainer: two buckets, and the device it was asked for."""

    def __init__(self) -> None:
        self.devices: list[object] = []

    def iter_hf_weights(self, bucket_bytes: int, *, device: str | None = "cpu"):
        self.devices.append(device)
        yield [("a", torch.ones(2))]
        yield [("b", torch.zeros(3)), ("c", torch.ones(1))]


@dataclass
class Recorder:
    """A transport: what it was given, whether it was closed."""

    engines: list
    sent: list = field(default_factory=list)
    closed: bool = False

    def send(self, buckets) -> int:
        buckets = list(buckets)
        self.sent.append([name for b in buckets for name, _ in b])
        return sum(len(b) for b in buckets)

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class Factory:
    tag: str
    built: list = field(default_factory=list, compare=False, hash=False)
    restartable: ClassVar[bool] = True

    def __call__(self, engines) -> Recorder:
        transport = Recorder([e.handle for e in engines])
        self.built.append(transport)
        return transport


def _worker(rank: int) -> TrainWorker:
    return TrainWorker(rank, 2, None, None, Actor, gc_every=0)


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
    """A rank sets the torch.distributed variables; give them back after each test."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_rank_zero_sends_every_bucket_others_only_iterate():
    factory = Factory("ipc")
    rank0, rank1 = _worker(0), _worker(1)
    # three tensors of six float32 values: 24 bytes (the loop's perf/sync_gbps counts them)
    assert rank0.push_weights(["e0"], 1 << 20, factory) == (3, 24)
    assert rank1.push_weights(["e0"], 1 << 20, factory) == (0, 0)
    assert [t.sent for t in factory.built] == [[["a", "b", "c"]]]  # rank 1 built none
    # buckets stay where the weights live: the transport moves them if it must
    assert rank0.actor.devices == rank1.actor.devices == [None]
    assert isinstance(factory.built[0], WeightTransport)


def test_transport_is_kept_then_rebuilt_for_replaced_engines():
    worker, ipc, nccl = _worker(0), Factory("ipc"), Factory("nccl")
    worker.push_weights(["e0", "e1"], 1 << 20, ipc)
    worker.push_weights(["e0", "e1"], 1 << 20, ipc)
    worker.push_weights(["f0"], 1 << 20, nccl)  # another group: its own transport
    worker.push_weights(["e0", "e1"], 1 << 20, ipc)
    assert len(ipc.built) == 1 and len(ipc.built[0].sent) == 3
    worker.push_weights(["e0", "e9"], 1 << 20, ipc)  # engine 1 was restarted
    assert len(ipc.built) == 2 and ipc.built[0].closed and not ipc.built[1].closed
    assert ipc.built[1].engines == ["e0", "e9"] and not nccl.built[0].closed
