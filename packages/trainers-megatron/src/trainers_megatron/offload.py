"""Move the trainer's GPU memory to the host and back without breaking tensor views.

Under megatron-core's DDP the parameters and ``main_grad`` are views into contiguous buffers,
and the distributed optimizer's shards (float32 weights) view those buffers too; replacing a
tensor's ``.data`` (as ``Module.to`` or megatron-core's ``MegatronOptimizer.offload_to_cpu``
do) would cut a view off its buffer, and the optimizer would then update a copy. So whole
storages move: each is copied to (pinned) host memory and resized to 0 bytes, every view of it
kept; on return it is resized and filled again, the same way megatron-core's
``_ParamAndGradBuffer.offload_to_cpu`` frees its buffers.

At host-link speed: the host buffers are page-locked and kept from one offload to the next (a
colocated run moves the same storages every step); a storage of at least ``direct_bytes``
moves in one copy of its own, the smaller ones (norms, biases, the vision tower's pieces and
their optimizer state: hundreds of tensors of kilobytes, where each copy's fixed cost would
dominate) are packed on the device into buckets of up to ``bucket_bytes`` that cross in one
copy each; and storages whose contents need not survive (the gradient buffers between steps,
which hold zeros) are freed without a copy and come back zero-filled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    """Small storages that cross together: their bytes end to end in one host buffer."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """A uint8 tensor over the whole of ``storage`` (a view: writes reach the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class StorageOffload:
    """The storages of some tensors, moved out (:meth:`offload`) and back (:meth:`onload`);
    see the module docstring for how they travel."""

    def __init__(self, *, direct_bytes: int = 4 << 20, bucket_bytes: int = 64 << 20) -> None:
        self.direct_bytes = direct_bytes
        self.bucket_bytes = bucket_bytes
        # what is out: storages copied alone, buckets, storages dropped (zero on return)
        self._direct: list[tuple[torch.UntypedStorage, Tensor]] = []
        self._buckets: list[tuple[_Bucket, Tensor]] = []
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self._device: torch.device | None = None
        self._host: dict[tuple[str, int], Tensor] = {}  # reused: (kind, index) -> host bytes

    @property
    def offloaded(self) -> bool:
        return bool(self._direct or self._buckets or self._dropped)

    @property
    def host_bytes(self) -> int:
        """Host memory held for the storages (also while they are on the device)."""
        return sum(h.numel() for h in self._host.values())

    def _host_buffer(self, kind: str, index: int, nbytes: int) -> Tensor:
        host = self._host.get((kind, index))
        if host is None or host.numel() != nbytes:  # new, or another storage's place
            pin = torch.cuda.is_available()
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self._host[(kind, index)] = host
        return host

    def offload(self, tensors: Iterable[Tensor], *, drop: Iterable[Tensor] = ()) -> int:
        """Copy each distinct storage of ``tensors`` to the host and free it; free those of
        ``drop`` without a copy (:meth:`onload` gives them back zero-filled). Returns the
        bytes copied."""
        if self.offloaded:
            raise RuntimeError("already offloaded")
        dropped = _distinct(drop)
        dropped_ptrs = {s.data_ptr() for s, _ in dropped}
        kept = [(s, d) for s, d in _distinct(tensors) if s.data_ptr() not in dropped_ptrs]
        if not kept and not dropped:
            return 0
        device = (kept or dropped)[0][1]
        self._device = device
        non_blocking = device.type == "cuda" and torch.cuda.is_available()
        buckets: list[_Bucket] = []
        for storage, _ in kept:
            nbytes = storage.nbytes()
            if nbytes >= self.direct_bytes:
                host = self._host_buffer("direct", len(self._direct), nbytes)
                host.copy_(_bytes_of(storage, device), non_blocking=non_blocking)
                self._direct.append((storage, host))
                continue
            if not buckets or buckets[-1].nbytes + nbytes > self.bucket_bytes:
                buckets.append(_Bucket())
            buckets[-1].storages.append(storage)
            buckets[-1].sizes.append(nbytes)
        for i, bucket in enumerate(buckets):
            # packed on the device (one kernel), then one copy; the stream orders the next
            # bucket's packing after this copy, and the packed tensor stays alive (the caching
            # allocator reuses its block only after the stream's later work)
            packed = torch.cat([_bytes_of(s, device) for s in bucket.storages])
            host = self._host_buffer("bucket", i, bucket.nbytes)
            host.copy_(packed, non_blocking=non_blocking)
            self._buckets.append((bucket, host))
        for kind, n in (("direct", len(self._direct)), ("bucket", len(self._buckets))):
            for key in [k for k in self._host if k[0] == kind and k[1] >= n]:
                del self._host[key]  # places no storage holds any more
        if non_blocking:
            torch.cuda.synchronize(device)  # every copy landed before any storage is freed
        for storage, _ in self._direct:
            storage.resize_(0)
        for bucket, _ in self._buckets:
            for storage in bucket.storages:
                storage.resize_(0)
        for storage, _ in dropped:
            self._dropped.append((storage, storage.nbytes()))
            storage.resize_(0)
        return self.moved_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes that cross the host link each way for what is out now."""
        direct = sum(h.numel() for _, h in self._direct)
        return direct + sum(h.numel() for _, h in self._buckets)

    def onload(self) -> int:
        """Give every storage its bytes back (the views see their old values again; dropped
        storages read zero). The copies are queued on the current stream; returns the bytes
        copied."""
        device = self._device
        moved = self.moved_bytes
        for storage, host in self._direct:
            storage.resize_(host.numel())
            _bytes_of(storage, device).copy_(host, non_blocking=True)
        for bucket, host in self._buckets:
            packed = host.to(device, non_blocking=True)
            for storage, part in zip(bucket.storages, packed.split(bucket.sizes), strict=True):
                storage.resize_(part.numel())
                _bytes_of(storage, device).copy_(part)
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
            _bytes_of(storage, device).zero_()
        self._direct, self._buckets, self._dropped = [], [], []
        return moved


def _distinct(tensors: Iterable[Tensor]) -> list[tuple[torch.UntypedStorage, torch.device]]:
    """Each storage of ``tensors`` once, with its device, in first-seen order (empty ones out)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append((storage, t.device))
    return out


def largest_live_cuda_tensors(count: int = 8) -> str:
    """The ``count`` largest CUDA storages reachable from Python, by shape, dtype and size:
    what names the reference that holds memory a colocated engine needs back."""
    import gc

    live = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, Tensor) and obj.is_cuda:
                live[obj.untyped_storage().data_ptr()] = obj
        except Exception:  # gc holds objects that refuse inspection
            continue
    largest = sorted(live.values(), key=lambda t: t.untyped_storage().nbytes(), reverse=True)
    described = ", ".join(
        f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB"
        for t in largest[:count]
    )
    return described or "none reachable from Python"


def report_leftovers(threshold: int = 1 << 30) -> None:
    """Warn, naming the largest live CUDA tensors, when an offload leaves memory behind: a
    colocated engine needs it back, and the tensors' shapes say which reference still holds it."""
    allocated = torch.cuda.memory_allocated()
    if allocated < threshold:
        return
    logger.warning(
        "offload left %.1f GiB allocated on the GPU (reserved %.1f GiB); largest live tensors: %s",
        allocated / 2**30,
        torch.cuda.memory_reserved() / 2**30,
        largest_live_cuda_tensors(),
    )
