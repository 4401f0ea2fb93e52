"""What runs inside each Ray actor of a group, in that actor's process: one trainer rank
(`TrainWorker`: the torch.distributed variables, then the actor the app's factory builds) or
one rollout engine (`EngineWorker`). The groups that start and drive them from the driver are
`rl_runtime.actor_group`'s; these classes see only the protocols, never a concrete backend.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray

from rl_runtime.gc_policy import PeriodicGC
from weight_sync import TransportFactory, WeightTransport
from weight_sync.object_store import RemoteEngine


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def probe_address() -> tuple[str, int]:
    """This node's address and a free port: where a trainer group's rank 0 will rendezvous
    (run as a Ray task on rank 0's bundle before the ranks start)."""
    return ray.util.get_node_ip_address(), _free_port()


#: the logger a trainer writes its start-up phases to (`trainer_core.startup`): shown at INFO
#: whatever the workers' level, a few lines per rank that name where a slow start-up is
STARTUP_LOGGER = "glimpse.startup"
#: the logger of a step's progress inside a worker (a long train phase's micro-batches,
#: `rl_algos.train_step`; what a compile cost, `trainer_core.compile_log`): shown at INFO too
PROGRESS_LOGGER = "glimpse.progress"
#: the logger of what a colocated process holds of the GPU when the other takes it (the
#: engine's KV cache at each allocation, what a trainer keeps against the plan): shown at INFO
MEMORY_LOGGER = "glimpse.memory"


def _configure_worker_logging(level: str) -> None:
    """Worker logs reach the driver's console through Ray; keep them to what matters."""
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for name in (STARTUP_LOGGER, PROGRESS_LOGGER, MEMORY_LOGGER):
        shown = logging.getLogger(name)
        shown.setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))


class TrainWorker:
    """One trainer rank. Sets the torch.distributed variables, then builds the actor."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str | None,
        master_port: int | None,
        factory: Callable[[], Any],
        log_level: str = "WARNING",
        gc_every: int = 50,
    ) -> None:
        _configure_worker_logging(log_level)
        self.rank = rank
        self.world_size = world_size
        if world_size > 1 or master_addr:
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK="0",  # Ray shows each rank only its own GPU
                MASTER_ADDR=str(master_addr),
                MASTER_PORT=str(master_port),
            )
        else:
            # A world of one: launcher variables inherited from the driver's shell (torchrun,
            # SLURM, a test that set them) would make the trainer join a group that isn't its.
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key, None)
        self.actor = factory()
        self._gc = PeriodicGC(gc_every)  # no collector pauses inside a step
        self._transports: list[tuple[TransportFactory, list[Any], WeightTransport]] = []

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    def compute_logprobs(self, batch: Any, reference: bool = False) -> list[Any]:
        return self.actor.compute_logprobs(batch, reference=reference)

    def train_step(self, batch: Any, loss: str = "grpo") -> dict[str, float]:
        metrics = self.actor.train_step(batch, loss=loss)
        self._gc.step()
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self.actor.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(path)

    def export_hf(self, path: str) -> None:
        self.actor.export_hf(path)

    def offload(self) -> dict[str, float] | None:
        return self.actor.offload()

    def onload(self) -> dict[str, float] | None:
        return self.actor.onload()

    def release_cache(self) -> None:
        self.actor.release_cache()

    def push_weights(
        self, engines: Sequence[Any], bucket_bytes: int, transport: TransportFactory
    ) -> int:
        """Send the current weights to every engine through the transport ``transport`` builds.

        Every rank iterates the buckets (gathering full tensors is collective), on the device
        where the weights live; rank 0 sends them. The transport is built once and kept (a
        broadcast group is set up once), and built again when the engines were replaced.
        Returns the number of tensors and of bytes sent (none on the other ranks).
        """
        buckets = iter(self.actor.iter_hf_weights(bucket_bytes, device=None))
        if self.rank != 0:
            for _ in buckets:
                pass  # take part in the gathering, send nothing
            return 0, 0
        counted = [0]
        try:
            sent = self._transport_for(transport, list(engines)).send(_count(buckets, counted))
            return sent, counted[0]
        except Exception:
            # an engine died mid-push: the other ranks still gather the remaining buckets
            # (collectives); finish with them so that the loop can restart it and push again
            for _ in buckets:
                pass
            raise

    def _transport_for(self, factory: TransportFactory, engines: list[Any]) -> WeightTransport:
        """The transport ``factory`` built for ``engines``; one per factory (factories compare
        by value), built again when that factory's engines were replaced."""
        for i, (known, known_engines, transport) in enumerate(self._transports):
            if known == factory:
                if known_engines == engines:
                    return transport
                del self._transports[i]
                transport.close()
                break
        transport = factory([RemoteEngine(e) for e in engines])
        self._transports.append((factory, engines, transport))
        return transport


def _count(buckets: Iterator[list[tuple[str, Any]]], total: list[int]) -> Iterator[Any]:
    """``buckets`` as they come, their bytes added to ``total[0]``."""
    for bucket in buckets:
        total[0] += sum(t.numel() * t.element_size() for _, t in bucket)
        yield bucket


class EngineWorker:
    """One rollout engine. `request_fn(prompt)` and `params_fn(**sampling)` turn the loop's
    prompts and sampling dict into the engine's request and parameter types."""

    def __init__(
        self,
        factory: Callable[[], Any],
        request_fn: Callable[[Any], Any],
        params_fn: Callable[..., Any],
        log_level: str = "WARNING",
        cuda_visible_devices: str | None = None,
    ) -> None:
        _configure_worker_logging(log_level)
        if cuda_visible_devices is not None:
            # a colocated engine of several GPUs: its TP ranks (processes SGLang starts)
            # inherit these GPUs and use cuda:0..N-1 (base_gpu_id=0)
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self.engine = factory()
        self.request_fn = request_fn
        self.params_fn = params_fn

    def generate(self, prompts: Sequence[Any], n: int, sampling: dict[str, Any]) -> list[Any]:
        requests = [self.request_fn(p) for p in prompts for _ in range(n)]
        if not requests:
            return []
        return self.engine.generate(requests, self.params_fn(**sampling))

    def update_weights(self, bucket: list[tuple[str, Any]]) -> None:
        self.engine.update_weights([bucket])

    def stats(self) -> dict[str, float]:
        """Where the engine's last generate spent its time, if it says (``last_stats``)."""
        return dict(getattr(self.engine, "last_stats", None) or {})

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` here: the engine-side half of a weight transport (CUDA IPC,
        NCCL), which rl-runtime does not know (`weight_sync.object_store.RemoteEngine.submit`)."""
        return fn(self.engine, *args)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.engine.resume_memory(tags)

    def health(self) -> bool:
        return bool(self.engine.health())

    def shutdown(self) -> None:
        self.engine.shutdown()
