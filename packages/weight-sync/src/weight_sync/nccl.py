"""Weight sync from a trainer to SGLang engines in another placement, over a broadcast group.

The trainer (rank 0) and every engine's tensor-parallel workers (ranks ``1..``) join a process
group of their own, apart from the trainer's default group. SGLang builds its side when asked
through ``init_weights_update_group``; :func:`init_weight_sync_group` builds the trainer's side
the same way (a TCP rendezvous, a store prefixed by the group name, a fresh backend), so the
two meet. Then, per bucket, the engine is told the names, dtypes and shapes to expect
(``update_weights_from_distributed``) while the trainer broadcasts the tensors in that order,
all inside one weight-update session per engine (``begin_weight_update`` /
``end_weight_update``; sglang 0.5.23 refuses the update outside one, and the trainer's
broadcast would then wait until the group times out).

The engines are the SGLang engines' own receiving side (``rollout_sglang``'s ``SGLangEngine``
and ``SGLangClient`` have every method :class:`DistributedWeightSender` calls); in a Ray run they
are links (``submit(fn, *args) -> Future`` running ``fn(engine, *args)`` in the engine's
process), which :class:`LinkedEngine` turns back into blocking engine calls. :class:`Nccl` is
the factory a launcher passes for SGLang engines on GPUs of their own.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from weight_sync.protocol import NamedTensors
from weight_sync.weight_names import WeightNameCheck, check_weight_names

logger = logging.getLogger(__name__)


def init_weight_sync_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=10),
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join a process group separate from (and usable without) the default one.

    Rank 0 may pass the ``store`` it already serves (:func:`serve_weight_sync_store`); the
    others rendezvous over TCP at ``master_address:master_port``. ``timeout`` bounds the
    rendezvous and every collective, so a peer that never comes fails instead of hanging.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if store is None:
        store, rank, world_size = next(
            rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def serve_weight_sync_store(
    master_address: str, master_port: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening before any peer is told where to connect.

    ``master_port=0`` lets the OS pick a free port (read it from ``store.port``): no window in
    which another process can take a port chosen in advance; a fixed port already in use fails
    here at once rather than sending the peers to someone else's store.
    """
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
    )


def broadcast_bucket(bucket: NamedTensors, group: dist.ProcessGroup, src: int = 0) -> None:
    """Broadcast each tensor of ``bucket`` in order (contiguous, as the receivers allocate)."""
    for _, tensor in bucket:
        dist.broadcast(tensor.contiguous(), src=src, group=group)


def bucket_spec(bucket: NamedTensors) -> dict[str, list[Any]]:
    """What a receiver must allocate: names, dtype names (``"bfloat16"``) and shapes."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


class DistributedWeightSender:
    """The trainer's side of weight sync to engines in a separate placement.

    ``engines`` are objects with ``init_weights_update_group(...)``,
    ``update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache)``,
    ``begin_weight_update()``, ``end_weight_update()`` and ``flush_cache()``
    (``rollout_sglang``'s ``SGLangEngine`` and ``SGLangClient`` have them all). ``ranks_per_engine``
    is each engine's tensor-parallel size. Tensors must be on a device the backend can send
    (CUDA for NCCL, CPU for gloo).

    The trainer serves the rendezvous store before asking the engines to join; the default
    ``master_port=0`` lets the OS pick a free port (``self.master_port``). ``weight_names``
    checks every bucket's names before the engines are told to receive it. ``timeout`` bounds
    the rendezvous, every broadcast and every engine's answer: a missing engine is an error
    after ``timeout``, never a hang. (SGLang's own side uses its default timeout.)
    """

    def __init__(
        self,
        engines: list[Any],
        *,
        master_address: str,
        master_port: int = 0,
        ranks_per_engine: int | list[int] = 1,
        group_name: str = "glimpse_weight_sync",
        backend: str = "nccl",
        timeout: timedelta = timedelta(minutes=10),
        weight_names: WeightNameCheck | None = None,
    ) -> None:
        self.engines = engines
        self.weight_names = weight_names
        self.backend = backend
        sizes = (
            [ranks_per_engine] * len(engines)
            if isinstance(ranks_per_engine, int)
            else list(ranks_per_engine)
        )
        self.group_name = group_name
        self.world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
        self.timeout = timeout
        store = serve_weight_sync_store(master_address, master_port, self.world_size, timeout)
        self.master_port = store.port
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(engines)))
        # The engines block in their rendezvous until the trainer joins: ask them first, in
        # the background, then join.
        futures = [
            self._pool.submit(
                engine.init_weights_update_group,
                master_address=master_address,
                master_port=self.master_port,
                rank_offset=offset,
                world_size=self.world_size,
                group_name=group_name,
                backend=backend,
            )
            for engine, offset in zip(engines, offsets, strict=True)
        ]
        try:
            self.group = init_weight_sync_group(
                backend=backend,
                master_address=master_address,
                master_port=self.master_port,
                world_size=self.world_size,
                rank=0,
                group_name=group_name,
                timeout=timeout,
                store=store,
            )
            _wait(futures, "init_weights_update_group", timeout)
        except BaseException:
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        logger.info("weight sync group %r ready: %d ranks", group_name, self.world_size)

    def send(
        self,
        buckets: Iterable[NamedTensors],
        *,
        to_device: Callable[[Tensor], Tensor] | None = None,
    ) -> int:
        """Send every bucket to every engine, inside one weight-update session per engine;
        returns the number of tensors sent. Tensors go where the backend sends from (a GPU
        for NCCL, the host for gloo) unless ``to_device`` says otherwise."""
        if to_device is None:
            to_device = self._to_backend_device
        self._on_all("begin_weight_update")
        try:
            count = self._broadcast_all(buckets, to_device)
        except BaseException:
            try:
                self._on_all("end_weight_update")
            except Exception:  # the broadcast's error is the one to report
                logger.warning("end_weight_update after a failed send also failed", exc_info=True)
            raise
        self._on_all("end_weight_update")
        self._on_all("flush_cache")
        return count

    def _to_backend_device(self, tensor: Tensor) -> Tensor:
        if self.backend == "nccl":
            if tensor.device.type == "cuda":
                return tensor
            return tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor.to("cpu")

    def _on_all(self, method: str) -> None:
        futures = [self._pool.submit(getattr(engine, method)) for engine in self.engines]
        _wait(futures, method, self.timeout)

    def _broadcast_all(
        self, buckets: Iterable[NamedTensors], to_device: Callable[[Tensor], Tensor] | None
    ) -> int:
        count = 0
        for bucket in buckets:
            # before any engine is told to receive: a refused name must not strand a broadcast
            check_weight_names([name for name, _ in bucket], self.weight_names)
            if to_device is not None:
                bucket = [(name, to_device(t)) for name, t in bucket]
            spec = bucket_spec(bucket)
            futures = [
                self._pool.submit(
                    engine.update_weights_from_distributed,
                    **spec,
                    group_name=self.group_name,
                    flush_cache=False,
                )
                for engine in self.engines
            ]
            broadcast_bucket(bucket, self.group)
            _wait(futures, "update_weights_from_distributed", self.timeout)
            count += len(bucket)
        return count

    def close(self) -> None:
        dist.destroy_process_group(self.group)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _wait(futures: list[Any], what: str, timeout: timedelta) -> None:
    """Each engine's answer; an engine silent for longer than ``timeout`` is an error."""
    for future in futures:
        try:
            result = future.result(timeout=timeout.total_seconds())
        except FuturesTimeout:
            raise TimeoutError(f"{what}: an engine did not answer within {timeout}") from None
        if isinstance(result, tuple | list) and result and result[0] is False:
            raise RuntimeError(f"{what} failed on an engine: {result}")
        if isinstance(result, dict) and result.get("success") is False:
            raise RuntimeError(f"{what} failed on an engine: {result.get('message', result)}")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


# ------------------------------------------------------------- transports for a Ray run


def _call(engine: Any, method: str, kwargs: dict[str, Any]) -> Any:
    return getattr(engine, method)(**kwargs)


class LinkedEngine:
    """An engine behind a link (``submit(fn, *args) -> Future``, rl-runtime's ``RemoteEngine``)
    as the blocking engine :class:`DistributedWeightSender` calls. A dead engine's error
    (Ray's) is raised as it came."""

    def __init__(self, link: Any) -> None:
        self.link = link

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.link.submit(_call, method, kwargs).result()

    def init_weights_update_group(self, **kwargs: Any) -> Any:
        return self._call("init_weights_update_group", **kwargs)

    def update_weights_from_distributed(self, **kwargs: Any) -> Any:
        return self._call("update_weights_from_distributed", **kwargs)

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def flush_cache(self) -> None:
        self._call("flush_cache")


def _node_address() -> str:
    """This node's address for the broadcast group's rendezvous (Ray's view where it runs)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # no Ray here: a single-node run
        return "127.0.0.1"


@dataclass(frozen=True)
class Nccl:
    """Factory of a :class:`DistributedWeightSender` over links to the engines (engines on GPUs
    of their own; ``backend="gloo"`` on CPUs). The group is set up once: a replaced engine
    could not join it, so these engines are not restarted."""

    ranks_per_engine: int = 1
    backend: str = "nccl"
    weight_names: WeightNameCheck | None = None
    restartable: ClassVar[bool] = False

    def __call__(self, engines: list[Any]) -> DistributedWeightSender:
        return DistributedWeightSender(
            [LinkedEngine(e) for e in engines],
            master_address=_node_address(),
            ranks_per_engine=self.ranks_per_engine,
            backend=self.backend,
            weight_names=self.weight_names,
        )
