"""Every tensor storage an object keeps alive: what a trainer holds, counted once per storage.

A colocated trainer's resident memory is planned per backend (``resident_bytes``); the tests
that hold each trainer to its plan take a real actor through a step and its release, then walk
everything it references and add up the distinct storages (views share one), by device.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterable

import torch
from torch import Tensor

# not walked into: classes, modules and functions lead to the whole interpreter
_LEAVES: tuple[type, ...] = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_LEAVES += (types.MethodType, types.CodeType, str, bytes, int, float)


def held_storages(root: object) -> dict[int, tuple[int, str]]:
    """Bytes and device type of every tensor storage reachable from ``root``, by address:
    through attributes, containers, modules, optimizer state, parameters' ``.grad``, the
    attributes set on tensors (megatron-core's ``main_grad``, ``decoupled_grad``,
    ``main_param``) and DTensors' local shards. Empty storages (freed by ``resize_(0)``, an
    FSDP unit's resharded full parameter) are left out."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    alive: list[object] = []  # objects made while walking (to_local) keep their ids unique
    out: dict[int, tuple[int, str]] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        alive.append(obj)
        if isinstance(obj, DTensor):
            stack.append(obj.to_local())
        elif isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes(), obj.device.type
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(getattr(obj, "__dict__", {}).values())
        else:
            stack.extend(gc.get_referents(obj))
    return out


def storage_ptrs(tensors: Iterable[Tensor | None]) -> set[int]:
    """The addresses of the (non-empty) storages of ``tensors`` (None skipped)."""
    out = set()
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            out.add(t.untyped_storage().data_ptr())
    return out


def device_bytes(root: object, device: torch.device, *, host: Iterable[int] = ()) -> int:
    """Bytes of the storages ``root`` keeps on ``device``'s type, less those at the addresses
    ``host`` (storages that live on the host by design: where the CPU plays the device, the
    type alone cannot tell them apart)."""
    skip = set(host)
    held = held_storages(root).items()
    return sum(n for ptr, (n, where) in held if where == device.type and ptr not in skip)


#: CUDA caching allocator: blocks of 1-10 MiB share 20 MiB segments, smaller ones 2 MiB ones
SHARED_SEGMENT = 20 << 20


def pinned_free_bytes(min_segment: int = SHARED_SEGMENT) -> int:
    """Free bytes that ``torch.cuda.empty_cache`` cannot give back from segments larger than
    ``min_segment``: blocks freed inside a segment where a live block stays. Those are what a
    step's activations leave when a tensor kept past it lands among them; the allocator's
    shared small segments (many small live tensors) are left out, as they are its design."""
    return sum(
        seg["total_size"] - seg["allocated_size"]
        for seg in torch.cuda.memory_snapshot()
        if seg["total_size"] > min_segment and seg["allocated_size"] > 0
    )
