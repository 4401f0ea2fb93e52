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

from collections.abc import Iterable

import torch
from torch import Tensor


class StorageOffload:
    """The storages of some tensors, moved out (:meth:`offload`) and back (:meth:`onload`)."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[Tensor]) -> int:
        """Copy each distinct storage of ``tensors`` to the host and free it; bytes moved."""
        if self._saved:
            raise RuntimeError("already offloaded")
        seen: set[int] = set()
        moved = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = torch.empty(
                storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
            host.copy_(source)
            storage.resize_(0)
            self._saved.append((storage, host))
            moved += host.numel()
        return moved

    def onload(self) -> None:
        """Give every storage its bytes back (the views see their old values again)."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            target = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            target.copy_(host, non_blocking=True)
        self._saved = []
