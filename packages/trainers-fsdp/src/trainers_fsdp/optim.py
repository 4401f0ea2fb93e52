"""AdamW, learning-rate schedules and gradient-norm clipping that work on sharded (DTensor) params."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainers_fsdp.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only.

    Norm weights and biases (1-D) are not decayed, the usual practice. On CUDA the fused kernel
    is used (it takes DTensor parameters); on CPU the foreach implementation.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=fused,
        foreach=None if fused else True,
    )


def lr_lambda(cfg: OptimConfig):
    """The multiplier of ``cfg.lr`` at each step: linear warmup, then constant or cosine."""

    def factor(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        if cfg.total_steps is None:
            raise ValueError("lr_schedule='cosine' needs optim.total_steps")
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """A per-optimizer-step scheduler (call ``step()`` after each ``optimizer.step()``)."""
    return LambdaLR(optimizer, lr_lambda(cfg))


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (over all ranks), clipped to ``max_norm`` when > 0.

    With DTensor gradients ``clip_grad_norm_`` returns a DTensor norm whose local value is only
    this rank's part; ``full_tensor()`` reduces it. A non-finite norm is returned unclipped
    so the caller can skip the step.
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm([p.grad for p in grads], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm.float()
    if max_norm > 0:
        value = float(norm)  # one host sync per step
        if math.isfinite(value) and value > max_norm:
            coef = max_norm / (value + 1e-6)
            for p in grads:
                p.grad.mul_(coef)
    return norm


def _sharded_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (float32) of FSDP-sharded gradients, computed on the local shards.

    When every gradient is a DTensor sharded (no replication) over one mesh, the squared norm is
    the sum over ranks of the local squared norms: one foreach norm over plain tensors and one
    all-reduce, instead of DTensor dispatch for each of hundreds of gradients. Anything else goes
    through ``get_total_norm``.
    """
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    all_sharded = len(meshes) == 1 and all(
        isinstance(g, DTensor) and all(p.is_shard() for p in g.placements) for g in grads
    )
    if not all_sharded:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()
    local = [g.to_local() for g in grads]
    norms = torch._foreach_norm(local, 2.0, dtype=torch.float32)
    squared = torch.stack(norms).square().sum()
    mesh = meshes.pop()
    if mesh.size() > 1:
        torch.distributed.all_reduce(squared, group=mesh.get_group())
    return squared.sqrt()


def fused_skip_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device (fused Adam/AdamW ``found_inf``)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(
        optimizer.defaults.get("fused")
    )


@torch.no_grad()
def clip_and_step_on_device(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Clip the gradients and step a fused AdamW without reading anything on the host.

    The clip factor stays a device tensor and reaches the fused kernel as ``grad_scale``, by
    which it divides each gradient as it reads it (so clipping costs no pass of its own over the
    gradients), and a non-finite norm reaches it as ``found_inf``, which leaves parameters,
    moments and step counts unchanged: the two hooks AMP's grad scaler uses. Returns the global
    gradient norm as a device tensor; the caller reads it with the step's other metrics in one
    transfer.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = _sharded_grad_norm(grads)
    finite = torch.isfinite(norm)
    if max_norm > 0:
        optimizer.grad_scale = torch.where(finite, ((norm + 1e-6) / max_norm).clamp(min=1.0), 1.0)
    optimizer.found_inf = (~finite).float()
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = optimizer.grad_scale = None
    return norm
