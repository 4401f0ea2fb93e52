"""The FSDP actor's state to the host and back around a colocated rollout, and its gradient
buffers freed between steps.

Apart from the actor because these follow how each kind of state is laid out (the one-rank
flat masters and their views, FSDP's sharded DTensors, AdamW's moments) and count the bytes
that cross; the actor only decides when (``offload`` / ``onload``, ``release_cache``).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from trainers_fsdp.flat_adamw import FlatAdamW, move_optimizer_state
from trainers_fsdp.master import MasterWeights

logger = logging.getLogger(__name__)
#: what a colocated trainer keeps at each release (``rl_runtime.workers.MEMORY_LOGGER``)
memory_logger = logging.getLogger("glimpse.memory")


def move_state(
    model: nn.Module,
    masters: MasterWeights | None,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    offload: bool,
) -> int:
    """Everything to ``device`` (the copies queued, not waited for); bytes copied.
    ``offload``: the bf16 weights are left unfilled (nothing runs until they come back).

    On one GPU the state is a few flat buffers (float32 masters, AdamW's two moments,
    an accumulated gradient), each one copy through reused pinned host buffers
    (:class:`trainer_core.HostCopies`); the bf16 weights are cast again from the masters.
    """
    moved = 0
    if masters is not None:  # the flat buffers first: model.to then keeps the views
        masters.to(device, fill=not offload)
        moved += masters.take_moved()
    flat = masters is not None
    moved += sum(_nbytes(t) for t in model.parameters() if not flat and t.device != device)
    model.to(device)
    for p in model.parameters():
        if p.grad is not None:
            if p.grad.device != device and not flat:
                moved += _nbytes(p.grad)
            p.grad = p.grad.to(device)
    # AdamW's state: FlatAdamW's two flat moments (the per-parameter ones views of them) or
    # a tensor per parameter, and the step counts; each storage counted once
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, Tensor) and v.device != device
    }
    moved += sum(storages.values())
    move_optimizer_state(optimizer, device)
    logger.info("actor state moved to %s", device)
    return moved


def free_grad_buffers(masters: MasterWeights | None, optimizer: torch.optim.Optimizer) -> int:
    """The one-rank masters' gradient buffers freed while they hold nothing, and the
    optimizer's views of them; the bytes freed (0: none, or an accumulated gradient kept).
    Without masters there is nothing to free: ``.grad`` is already None after a step."""
    if masters is None:
        return 0
    grads = (masters.compute_grad, masters.grad)
    held = sum(_nbytes(g) for g in grads if g is not None)
    if not masters.release_grads():
        return 0
    if isinstance(optimizer, FlatAdamW):
        optimizer.forget_grads()
    return held


def release_cached_memory(device: torch.device, *, freed: int, planned: float) -> None:
    """``release_cache`` on CUDA, after the gradients (``freed`` bytes of them): blocks of a
    CUDA-IPC push that the engine has let go and the allocator's cache back to the device;
    logged beside what stays allocated and what the colocation plan counts (``planned``)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    memory_logger.info(
        "release_cache: %.1f GiB of cached GPU memory given back%s; %.1f GiB allocated "
        "(%.1f reserved) stays, the plan counts %.1f",
        (before - reserved) / 2**30,
        f" (gradients {freed / 2**30:.1f} GiB among it)" if freed else "",
        torch.cuda.memory_allocated(device) / 2**30,
        reserved / 2**30,
        planned / 2**30,
    )


def _nbytes(t: Tensor) -> int:
    """Bytes this rank holds of ``t`` (its shard of a DTensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
