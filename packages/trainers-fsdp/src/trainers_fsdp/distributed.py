"""Process-group and device setup for the actor.

The actor initialises ``torch.distributed`` itself when the caller has not: from the usual
launcher variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``
as torchrun and Ray set them), or as a single process with an in-memory store when none is set,
so ``FsdpActor(config)`` works in a notebook without any environment.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"``: this process's GPU (``LOCAL_RANK``) when CUDA is present, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_distributed(device: torch.device, *, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group if needed; returns ``(rank, world_size)``.

    gloo on CPU, NCCL on GPU. Without launcher variables the group is a world of one backed by
    an in-memory store, so no port is opened.
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=_device_id(device))
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        logger.info(
            "process group: %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size()
        )
    return dist.get_rank(), dist.get_world_size()


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def build_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over all ranks: the data-parallel (FSDP) dimension."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def all_reduce_mean_(tensor: torch.Tensor) -> torch.Tensor:
    """In-place mean over all ranks: NCCL averages inside the collective, gloo (which has no
    average) sums and divides."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return tensor
    if dist.get_backend() == "nccl":
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    else:
        dist.all_reduce(tensor)
        tensor.div_(world)
    return tensor


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce, a no-op in a world of one. CPU tensors go through the GPU under
    NCCL (which reduces device tensors only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=op)
        tensor.copy_(on_device.cpu())
    else:
        dist.all_reduce(tensor, op=op)
    return tensor
