"""AdamW, learning-rate schedules and gradient-norm clipping that work on sharded (DTensor) params."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from rl_algos.optimizer import OptimConfig
from trainers_fsdp.flat_adamw import FlatAdamW
from trainers_fsdp.master import MasterWeights


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device: torch.device,
    masters: MasterWeights | None = None,
    *,
    host_threads: int | None = None,
    fused: bool | None = None,
    flat_update: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only.

    Norm weights and biases (1-D) are not decayed, the usual practice. With ``masters`` (one
    rank, bf16 compute; ``model`` is then ``masters.module``) it is a
    :class:`~trainers_fsdp.flat_adamw.FlatAdamW` (one pass per group over the flat buffers
    on CUDA, or as ``flat_update`` says; masters kept on the host step there, on
    ``host_threads`` threads). Otherwise, on CUDA (or as ``fused`` says) the fused kernel (it
    takes DTensor parameters); on CPU the foreach implementation.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    fused = fused if fused is not None else device.type == "cuda"
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if masters is not None:
        flat = flat_update if flat_update is not None else device.type == "cuda"
        return FlatAdamW(
            groups,
            masters,
            flat=flat,
            host_threads=host_threads,
            fused=fused,
            foreach=None if fused else True,
            **kw,
        )
    return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **kw)


def lr_lambda(cfg: OptimConfig):
    """The multiplier of ``cfg.lr`` at each step: linear warmup, then constant or cosine.

    Step ``s`` (from 0) is counted as megatron-core's ``OptimizerParamScheduler`` counts it
    after its ``step(1)``, ``n = s + 1``, so both backends follow one schedule: warmup
    ``n / warmup_steps``; cosine progress ``(n - warmup) / (total - warmup)``, reaching the
    floor on the last step.
    """

    def factor(step: int) -> float:
        n = step + 1
        if cfg.warmup_steps > 0 and n <= cfg.warmup_steps:
            return n / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        if cfg.total_steps is None:
            raise ValueError("lr_schedule='cosine' needs optim.total_steps")
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (n - cfg.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        floor = cfg.min_lr / cfg.lr
        return floor + (1.0 - floor) * cosine

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
    local_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)  # as get_total_norm
    mesh = meshes.pop()
    if mesh.size() == 1:
        return local_norm
    squared = local_norm.square()
    torch.distributed.all_reduce(squared, group=mesh.get_group())
    return squared.sqrt()


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (float32, on the device) of the parameters' gradients over all ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return _sharded_grad_norm(grads)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What clipping multiplies the gradients by: ``max_norm / norm`` above ``max_norm``."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0


@torch.no_grad()
def step_with_scaled_grads(optimizer: torch.optim.Optimizer, coef: float) -> None:
    """``optimizer.step()`` as if every gradient were multiplied by ``coef`` first.

    Fused AdamW (torch's and a flat :class:`~trainers_fsdp.flat_adamw.FlatAdamW`) takes the
    factor as ``grad_scale``, by which it divides each gradient as it reads it, the hook AMP's
    grad scaler uses: clipping then costs no pass of its own over the gradients. Other
    optimizers get the gradients scaled in place.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if coef != 1.0:
        flat = isinstance(optimizer, FlatAdamW) and optimizer.is_flat
        if flat or optimizer.defaults.get("fused"):
            device = params[0].device
            optimizer.grad_scale = torch.full((), 1.0 / coef, device=device)
        else:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None
