"""The host half of megatron-core's HybridDeviceOptimizer (``--optimizer-cpu-offload``) stepped
in pieces through :class:`trainer_core.host_adamw.HostAdamW`, the FSDP backend's host step, in
place of megatron-core's own (see :mod:`trainers_megatron.optim` for why)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from trainer_core.host_adamw import HostAdamW, HostPiece


class PiecewiseHostStep:
    """A HybridDeviceOptimizer's step with its host half through :class:`HostAdamW` (whose
    pinned pieces are kept from one step to the next).

    The learning rates and weight decays go to every sub-optimizer and the device half steps
    by megatron-core's own ``step`` (its host optimizers set aside for the call); the host
    half's AdamWs are stepped as torch's fused AdamW steps them (the step count first, then
    ``aten::_fused_adamw_`` on the same tensors); the sub-optimizers' state is then the hybrid
    optimizer's again (``_sync_sub_optimizers_state_to_hdo``), as after its own step
    (megatron-core 0.16.1, ``optimizer/cpu_offloading/hybrid_optimizer.py``)."""

    def __init__(self, hybrid: Any, threads: int | None = None) -> None:
        self.hybrid, self.threads = hybrid, threads
        self.host_step: HostAdamW | None = None

    def buffers(self) -> list[Tensor]:
        """The pinned pieces (host memory by design)."""
        step = self.host_step
        return [] if step is None else [*step._grads, *step._weights]

    def __call__(self, grad_scale: float | None, closure: Any = None) -> None:
        """One step; gradients divided by ``grad_scale`` (None: as they are)."""
        hybrid = self.hybrid
        hybrid._sync_hdo_param_groups_to_sub_optimizers()
        host, hybrid.cpu_optimizers = hybrid.cpu_optimizers, []
        try:
            type(hybrid).step(hybrid, closure)
        finally:
            hybrid.cpu_optimizers = host
        pieces = list(host_pieces(hybrid))
        if pieces:
            if self.host_step is None:
                weights = pieces[0].weights
                self.host_step = HostAdamW(weights.device, weights.dtype, threads=self.threads)
            self.host_step.step(pieces, grad_scale)
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
