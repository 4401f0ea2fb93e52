"""Host copies for colocated offload: pinned buffers made once and reused every step.

A colocated GRPO step moves the trainer's float32 masters and optimizer state off the GPU for
every rollout and back for every train phase, and the rollout engine its weights the other
way. ``Tensor.to("cpu")`` allocates new pageable host memory each time: the copy runs at
pageable speed and every page is faulted in anew. On the H200 (2026-12-01) the FSDP actor's
offload of the 2B shape's state took 5.9 s and the onload phase 5.2 s a step. Copying into
page-locked buffers that live from one offload to the next is a plain DMA each way, and the
device-to-host copies queue without waiting; the caller synchronises once before it frees
the device memory (``torch.cuda.synchronize()``, then ``empty_cache``).

The buffers stay allocated (host memory the size of what is offloaded, page-locked), which is
what colocation trades for speed; ``pin=False`` keeps the same reuse over plain memory (CPU
tests, or a host short of lockable memory).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def pinned_empty(shape: int | Sequence[int], dtype: torch.dtype, *, pin: bool = True) -> Tensor:
    """An uninitialised host tensor, page-locked when ``pin`` (and CUDA is present), of exactly
    its own size. ``torch.empty(..., pin_memory=True)`` goes through torch's caching host
    allocator, which rounds every block up to a power of two: a 26 GiB optimizer buffer takes
    32 GiB of locked memory, and on the H200 (2026-12-04) the 8B FSDP trainer's three such
    buffers held 17 GiB beyond its state. Large buffers are therefore plain memory registered
    with the driver (``cudaHostRegister``), unregistered when the returned tensor object is
    collected (keep it, not only a view or a ``.data`` that shares its storage); small ones
    keep the caching allocator (its reuse matters there, its rounding does not)."""
    out = torch.empty(shape, dtype=dtype)
    if not (pin and torch.cuda.is_available()) or out.numel() == 0:
        return out
    nbytes = out.numel() * out.element_size()
    if nbytes < PIN_REGISTER_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    cudart = torch.cuda.cudart()
    ptr = out.data_ptr()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (error {err})")
    weakref.finalize(out, cudart.cudaHostUnregister, ptr)
    return out


#: buffers from this size up are registered rather than taken from the caching host allocator
PIN_REGISTER_BYTES = 64 << 20


def transfer_metrics(direction: str, nbytes: int, seconds: float) -> dict[str, float]:
    """A step's metrics for one offload or onload (``direction``): ``perf/{direction}_gb``,
    ``perf/{direction}_s`` (the copies, from the first queued to the last landed) and
    ``perf/{direction}_gbps``, the host link's rate (about 50 GB/s each way for pinned memory
    on a PCIe 5 x16 link; far below it means pageable memory or per-tensor overheads)."""
    gb = nbytes / 1e9
    return {
        f"perf/{direction}_gb": gb,
        f"perf/{direction}_s": seconds,
        f"perf/{direction}_gbps": gb / seconds if seconds > 0 else 0.0,
    }


@contextlib.contextmanager
def timed_copies(device: torch.device) -> Iterator[list[float]]:
    """Seconds of the copies queued inside (``[seconds]``, set on exit): the device is
    synchronised on entry (earlier work is not counted) and on exit (every copy landed)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    out = [0.0]
    start = time.perf_counter()
    yield out
    if cuda:
        torch.cuda.synchronize(device)
    out[0] = time.perf_counter() - start


class HostCopies:
    """Reused host twins of device tensors, one per key (``pin``: page-locked, default where
    CUDA is present)."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._host: dict[str, Tensor] = {}
        #: bytes copied either way since the last :meth:`take_moved`
        self.moved = 0

    def to_host(self, key: str, tensor: Tensor) -> Tensor:
        """``tensor``'s values in ``key``'s host buffer (made on first use, or when the shape or
        dtype changed). The copy is queued, not finished: synchronise before reading the buffer
        or freeing ``tensor``'s memory."""
        host = self._host.get(key)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = pinned_empty(tensor.shape, tensor.dtype, pin=self.pin)
            self._host[key] = host
        host.copy_(tensor, non_blocking=self.pin)
        self.moved += tensor.numel() * tensor.element_size()
        return host

    def to_device(self, host: Tensor, device: torch.device) -> Tensor:
        """A device copy of a host buffer (queued: the buffer is written again only by a later
        ``to_host``, which the same stream orders after it)."""
        self.moved += host.numel() * host.element_size()
        return host.to(device, non_blocking=True)

    def take_moved(self) -> int:
        """Bytes copied since the last call (for the step's transfer rate)."""
        moved, self.moved = self.moved, 0
        return moved

    def move(self, key: str, tensor: Tensor, device: torch.device) -> Tensor:
        """``tensor`` on ``device``: into ``key``'s host buffer when ``device`` is the CPU,
        else a device copy."""
        if device.type == "cpu":
            return self.to_host(key, tensor)
        return self.to_device(tensor, device)

    def move_module(self, module: nn.Module, device: torch.device, prefix: str = "") -> None:
        """Every parameter and buffer of ``module`` to ``device`` in place (``.data``, so the
        parameter objects and every reference to them stay), through the host buffers."""
        with torch.no_grad():
            for name, p in module.named_parameters(remove_duplicate=True):
                p.data = self.move(f"{prefix}p:{name}", p.data, device)
            for name, b in module.named_buffers(remove_duplicate=True):
                b.data = self.move(f"{prefix}b:{name}", b.data, device)

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(t.numel() * t.element_size() for t in self._host.values())


def host_cores() -> int:
    """The CPU cores this process may run on (a Ray actor's affinity is the machine's; its
    ``OMP_NUM_THREADS`` is the actor's CPU share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextmanager
def host_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for a while (None: :func:`host_cores`).

    An optimizer step on the host is bound by memory bandwidth, which one or two threads (a
    trainer actor's CPU share) are far from using; the GPU idles while it runs, so the step
    takes every core it may run on."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads or host_cores()))
    try:
        yield
    finally:
        torch.set_num_threads(before)
