"""The host half of megatron-core's HybridDeviceOptimizer (``--optimizer-cpu-offload``) stepped
in pieces through :class:`trainer_core.host_adamw.HostAdamW`, the FSDP backend's host step, in
place of megatron-core's own (see :mod:`trainers_megatron.optim` for why)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from trainer_core.host_adamw import HostAdamW, HostPiece


def host_adamw_for(hybrid: Any, threads: int | None = None) -> HostAdamW:
    """A :class:`HostAdamW` writing into ``hybrid``'s device parameters (their device and
    dtype); one serves every hybrid optimizer of a model, one after another."""
    weights = next(iter(hybrid.cpu_copys_map_gpu_param.values()))
    return HostAdamW(weights.device, weights.dtype, threads=threads)


def step_in_pieces(
    hybrid: Any, host_adamw: HostAdamW, grad_scale: float | None, closure: Any = None
) -> None:
    """A HybridDeviceOptimizer's step with its host half through ``host_adamw``, gradients
    divided by ``grad_scale`` (None: as they are); returns once the weights are on the device.

    The learning rates and weight decays go to every sub-optimizer and the device half steps
    by megatron-core's own ``step`` (its host optimizers set aside for the call); the host
    half's AdamWs are stepped as torch's fused AdamW steps them (the step count first, then
    ``aten::_fused_adamw_`` on the same tensors); the sub-optimizers' state is then the hybrid
    optimizer's again (``_sync_sub_optimizers_state_to_hdo``), as after its own step
    (megatron-core 0.16.1, ``optimizer/cpu_offloading/hybrid_optimizer.py``)."""
    hybrid._sync_hdo_param_groups_to_sub_optimizers()
    host, hybrid.cpu_optimizers = hybrid.cpu_optimizers, []
    try:
        type(hybrid).step(hybrid, closure)
    finally:
        hybrid.cpu_optimizers = host
    pieces = list(host_pieces(hybrid))
    if pieces:
        host_adamw.step(pieces, grad_scale)
    hybrid._sync_sub_optimizers_state_to_hdo()


def host_pieces(hybrid: Any) -> Iterator[HostPiece]:
    """A :class:`HostPiece` for each offloaded parameter with a gradient, its AdamW step
    counted (torch's AdamW skips a parameter without one)."""
    for sub in hybrid.cpu_optimizers:
        for group in sub.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("the host step is AdamW without amsgrad or maximize")
            beta1, beta2 = group["betas"]
            for master in group["params"]:
                device_param = hybrid.cpu_copys_map_gpu_param[master]
                grad = optimizer_grad(device_param)
                if grad is None:
                    continue
                state = sub.state[master]
                if not state:
                    state.update(fresh_adam_state(master, group))
                state["step"] += 1
                yield HostPiece(
                    master.view(-1),
                    state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1),
                    state["step"],
                    grad.view(-1),
                    device_param.detach().view(-1),
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                )


def fresh_adam_state(p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
    """Zero moments and a zero step count, as torch.optim.adam's ``_init_group`` makes them:
    the step a float32 scalar on the parameter's device for the fused and capturable kernels,
    else on the host."""
    on_device = group.get("fused") or group.get("capturable")
    wide = torch.get_default_dtype() == torch.float64 and not on_device
    dtype = torch.float64 if wide else torch.float32
    state = {
        "step": torch.zeros((), dtype=dtype, device=p.device if on_device else "cpu"),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def optimizer_grad(p: Tensor) -> Tensor | None:
    """A parameter's gradient as the optimizer reads it: the precision-aware optimizer's
    ``decoupled_grad`` where set, else ``.grad``."""
    grad = getattr(p, "decoupled_grad", None)
    return p.grad if grad is None else grad
