"""Move the trainer's GPU memory to the host and back without breaking tensor views.

Under megatron-core's DDP the parameters and ``main_grad`` are views into contiguous buffers,
and the distributed optimizer's shards (float32 weights) view those buffers too; replacing a
tensor's ``.data`` (as ``Module.to`` or megatron-core's ``MegatronOptimizer.offload_to_cpu``
do) would cut a view off its buffer, and the optimizer would then update a copy. So whole
storages move: each is copied to (pinned) host memory and resized to 0 bytes, every view of it
kept; on return it is resized and filled again, the same way megatron-core's
``_ParamAndGradBuffer.offload_to_cpu`` frees its buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class StorageOffload:
    """The storages of some tensors, moved out (:meth:`offload`) and back (:meth:`onload`).

    The host buffers are kept and reused by the next offload of the same storages (a colocated
    run offloads the same tensors every step; pinning gigabytes anew each time cost more than
    the copy), and all copies of one offload are queued before one wait.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, Tensor]] = []
        self._host: list[Tensor] = []  # one per storage, in the order they were offloaded

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    @property
    def host_bytes(self) -> int:
        """Host memory held for the storages (also while they are on the device)."""
        return sum(h.numel() for h in self._host)

    def offload(self, tensors: Iterable[Tensor]) -> int:
        """Copy each distinct storage of ``tensors`` to the host and free it; bytes moved."""
        if self._saved:
            raise RuntimeError("already offloaded")
        seen: set[int] = set()
        storages: list[tuple[torch.UntypedStorage, torch.device]] = []
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            storages.append((storage, t.device))
        pin = torch.cuda.is_available()
        for i, (storage, device) in enumerate(storages):
            if i == len(self._host):
                self._host.append(torch.empty(0, dtype=torch.uint8))
            if self._host[i].numel() != storage.nbytes():  # new, or another storage's place
                self._host[i] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            self._host[i].copy_(source, non_blocking=pin and device.type == "cuda")
        del self._host[len(storages) :]
        if any(device.type == "cuda" for _, device in storages):
            torch.cuda.synchronize()  # every copy landed before any storage is freed
        for (storage, _), host in zip(storages, self._host, strict=True):
            storage.resize_(0)
            self._saved.append((storage, host))
        return sum(host.numel() for _, host in self._saved)

    def onload(self) -> None:
        """Give every storage its bytes back (the views see their old values again)."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            target = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            target.copy_(host, non_blocking=True)
        self._saved = []


def report_leftovers(threshold: int = 1 << 30) -> None:
    """Warn, naming the largest live CUDA tensors, when an offload leaves memory behind: a
    colocated engine needs it back, and the tensors' shapes say which reference still holds it."""
    allocated = torch.cuda.memory_allocated()
    if allocated < threshold:
        return
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
        for t in largest[:8]
    )
    logger.warning(
        "offload left %.1f GiB allocated on the GPU (reserved %.1f GiB); largest live tensors: %s",
        allocated / 2**30,
        torch.cuda.memory_reserved() / 2**30,
        described or "none reachable from Python",
    )
