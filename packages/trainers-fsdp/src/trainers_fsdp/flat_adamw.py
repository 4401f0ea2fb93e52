"""AdamW over :class:`~trainers_fsdp.master.MasterWeights`: one pass per parameter group.

torch's fused AdamW over a model's float32 masters makes a step of four passes over all
parameters: move the micro-batch's bf16 gradient into the float32 one, its norm, AdamW itself
(one launch per few tensors), and the cast of the masters back into the bf16 weights. For the
2B model that is about 98 GB of memory traffic. On the flat buffers the whole step is one
elementwise kernel per group that reads the gradient as it is (bf16 when the step had one
micro-batch), updates masters and moments and writes the bf16 weights and a zeroed gradient:
about 64 GB, plus 4 GB for the norm: 18.7 ms instead of 31.9 on an H200
(tools/bench/bench_flat_adamw.py, docs/performance.md). Uncompiled, on the CPU, the pass is
slower than torch's foreach AdamW, so the actor uses it on CUDA only.

The optimizer stays a ``torch.optim.AdamW``: its param groups, LR schedule and ``state_dict``
(per-parameter ``exp_avg``, ``exp_avg_sq``, ``step``, under the model's names) are torch's, so
checkpoints move between this and the FSDP actor. Its moments are views of two flat buffers;
a loaded state dict is copied back into them. The update follows torch's AdamW formula;
compiled, it equals torch's fused kernel to about one float32 rounding.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import Tensor

from trainer_core import HostCopies
from trainers_fsdp.master import MasterWeights, compiled_on

logger = logging.getLogger(__name__)


class FlatAdamW(torch.optim.AdamW):
    """AdamW whose parameters are :attr:`MasterWeights.module`'s; see the module docstring.

    ``grad_scale`` (an attribute, as torch's fused AdamW takes it from AMP): gradients are
    divided by it as they are read, which is how clipping costs no pass of its own. With
    ``flat=False``, or when a group is not one contiguous run of the flat buffers, each step is
    torch's own AdamW followed by the cast into the bf16 weights.
    """

    def __init__(
        self, param_groups: list[dict], masters: MasterWeights, *, flat: bool = True, **kw
    ):
        super().__init__(param_groups, **kw)
        self.masters = masters
        self.grad_scale: Tensor | None = None
        self._grad_views: tuple[tuple | None, list[Tensor]] = (None, [])  # per-parameter, cached
        self._runs = self._group_runs() if flat else None
        if flat and self._runs is None:
            logger.info("optimizer groups are not contiguous in the master buffers: per tensor")
        self.exp_avg = self.exp_avg_sq = None
        self._host = HostCopies()  # pinned host buffers for offload, reused (trainer_core)
        if self._runs is not None:
            n = masters.num_trainable
            self.exp_avg = torch.zeros(n, dtype=torch.float32, device=masters.device)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
            self._bind_state(fresh=True)
            self.register_load_state_dict_post_hook(lambda opt: opt._bind_state(fresh=False))

    @property
    def is_flat(self) -> bool:
        return self._runs is not None

    def _group_runs(self) -> list[tuple[int, int]] | None:
        """Each group's ``[start, end)`` in the flat buffers, or None if one is scattered."""
        runs = []
        for group in self.param_groups:
            spans = sorted(self.masters.span(p) for p in group["params"])
            if any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
                return None
            runs.append((spans[0][0], spans[-1][1]))
        return runs

    def _state_views(self, p: Tensor) -> tuple[Tensor, Tensor]:
        start, end = self.masters.span(p)
        return self.exp_avg[start:end].view_as(p), self.exp_avg_sq[start:end].view_as(p)

    @torch.no_grad()
    def _bind_state(self, *, fresh: bool) -> None:
        """Make every parameter's ``exp_avg`` / ``exp_avg_sq`` views of the flat buffers
        (``fresh``: zero moments at step 0; else copy in what a state dict load put there)."""
        device = self.masters.device
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                m, v = self._state_views(p)
                step = 0.0
                if not fresh and state:
                    for key, view in (("exp_avg", m), ("exp_avg_sq", v)):
                        if state[key].data_ptr() != view.data_ptr():
                            view.copy_(state[key])
                    step = state["step"]
                elif not fresh:  # no state saved for it: a fresh start
                    m.zero_()
                    v.zero_()
                state["step"] = torch.as_tensor(step, dtype=torch.float32).to(device).clone()
                state["exp_avg"], state["exp_avg_sq"] = m, v

    def to(self, device: torch.device) -> None:
        """Move the state (offload, onload) and re-point the per-parameter views."""
        if self._runs is None:
            _move_state_tensors(self, device)
            return
        self.exp_avg = self._host.move("exp_avg", self.exp_avg, device)
        self.exp_avg_sq = self._host.move("exp_avg_sq", self.exp_avg_sq, device)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state["step"].to(device, non_blocking=True)
                state["exp_avg"], state["exp_avg_sq"] = self._state_views(p)

    def take_moved(self) -> int:
        """Bytes the flat moments' moves copied since the last call."""
        return self._host.take_moved()

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """L2 norm (float32, on the device) of everything accumulated since the last step.

        Per parameter and then over the parameters, as ``torch.nn.utils.get_total_norm``
        does (one multi-tensor kernel): a single float32 reduction over the flat buffer is
        off by several float32 roundings on the CPU, which sums it sequentially. Per tensor
        (not flat), torch's step reads the float32 gradients, so they are made ready here."""
        grad = self.masters.single_grad() if self.is_flat else None
        if grad is None:
            grad = self.masters.ready_grads()
        key = (grad.data_ptr(), grad.dtype)
        if self._grad_views[0] != key:
            spans = [self.masters.span(p) for g in self.param_groups for p in g["params"]]
            self._grad_views = (key, [grad[a:b] for a, b in spans])
        norms = torch._foreach_norm(self._grad_views[1], 2.0, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """One AdamW step from the accumulated gradient; leaves the gradients zero and the
        model's bf16 weights cast from the new masters."""
        if closure is not None:
            raise ValueError("FlatAdamW.step takes no closure")
        masters = self.masters
        if self._runs is None:
            masters.ready_grads()
            super().step()
            masters.copy_to_model()
            masters.zero_grad()
            return
        grad = masters.single_grad()
        single = grad is not None
        if not single:
            grad = masters.ready_grads()
        device = masters.device
        scale = self.grad_scale
        if scale is None:
            scale = torch.ones((), device=device)
        update = compiled_on(device, _adamw_update)

        def fill(x: float) -> Tensor:  # a kernel argument, not a host-to-device copy
            return torch.full((), x, dtype=torch.float32, device=device)

        for group, (start, end) in zip(self.param_groups, self._runs, strict=True):
            steps = [self.state[p]["step"] for p in group["params"]]
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            update(
                masters.master[start:end],
                grad[start:end],
                self.exp_avg[start:end],
                self.exp_avg_sq[start:end],
                masters.compute[start:end],
                fill(group["lr"]),
                fill(group["weight_decay"]),
                fill(beta1),
                fill(beta2),
                fill(group["eps"]),
                steps[0],
                scale,
                single,
            )
        masters.zero_grad(compute_grad_zeroed=single)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move an optimizer's state to ``device`` (offload, onload); a FlatAdamW keeps its
    per-parameter state views of its flat buffers."""
    if isinstance(optimizer, FlatAdamW):
        optimizer.to(device)
    else:
        _move_state_tensors(optimizer, device)


def _move_state_tensors(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, Tensor):
                state[k] = v.to(device, non_blocking=True)


def _adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    compute: Tensor,
    lr: Tensor,
    weight_decay: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    step: Tensor,
    grad_scale: Tensor,
    zero_grad: bool,
) -> None:
    """torch's AdamW (decoupled decay, bias-corrected) on flat tensors, in place, then the
    low-precision copy; ``zero_grad`` zeroes the gradient it read."""
    g = grad.float() / grad_scale
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * g * g)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = exp_avg_sq.sqrt() / bias_correction2.sqrt() + eps
    param.sub_(exp_avg / denom * (lr / bias_correction1))
    compute.copy_(param)
    if zero_grad:
        grad.zero_()
