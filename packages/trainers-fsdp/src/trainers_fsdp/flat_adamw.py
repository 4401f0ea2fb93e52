"""AdamW over :class:`~trainers_fsdp.master.MasterWeights`: one pass per parameter group.

torch's fused AdamW over a model's float32 masters makes a step of four passes over all
parameters: move the micro-batch's bf16 gradient into the float32 one, its norm, AdamW itself
(one launch per few tensors), and the cast of the masters back into the bf16 weights. For the
2B model that is about 98 GB of memory traffic. On the flat buffers the whole step is one
elementwise kernel per group that reads the gradient as it is (bf16 when the step had one
micro-batch), updates masters and moments and writes the bf16 weights and a zeroed gradient:
about 64 GB, plus 4 GB for the norm: 18.7 ms instead of 31.9 on an H200
(tools/bench/bench_flat_adamw.py, docs/performance.md). On the CPU each run is one call of
torch's fused CPU AdamW kernel instead (the kernel the host step of an offloaded optimizer
uses); the actor's default there stays torch's per-tensor AdamW (``flat_update=None``).

The optimizer stays a ``torch.optim.AdamW``: its param groups, LR schedule and ``state_dict``
(per-parameter ``exp_avg``, ``exp_avg_sq``, ``step``, under the model's names) are torch's, so
checkpoints move between this and the FSDP actor. Its moments are views of two flat buffers;
a loaded state dict is copied back into them. The update follows torch's AdamW formula;
compiled, it equals torch's fused kernel to about one float32 rounding.

Masters kept on the host (``MasterWeights(host_fraction=...)``, ``--optimizer-cpu-offload``)
have their moments on the host too and are stepped there by
:class:`~trainer_core.host_adamw.HostAdamW` (torch's fused CPU AdamW); the rest steps on the
device as above. Offloading needs the flat layout (each group one run of the buffers).
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import Tensor

from trainer_core import HostCopies, pinned_empty
from trainer_core.host_adamw import HostAdamW, HostPiece
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
        self,
        param_groups: list[dict],
        masters: MasterWeights,
        *,
        flat: bool = True,
        host_threads: int | None = None,
        **kw,
    ):
        super().__init__(param_groups, **kw)
        self.masters = masters
        self.grad_scale: Tensor | None = None
        self._grad_views: tuple[tuple | None, list[Tensor]] = (None, [])  # per-parameter, cached
        offloaded = masters.host_end > 0
        self._runs = self._group_runs() if flat or offloaded else None
        if offloaded and self._runs is None:
            raise ValueError("optimizer offload needs each group to be one run of the masters")
        if flat and self._runs is None:
            logger.info("optimizer groups are not contiguous in the master buffers: per tensor")
        self.exp_avg = self.exp_avg_sq = None
        self._host = HostCopies()  # pinned host buffers for offload, reused (trainer_core)
        self._host_step = None
        if self._runs is not None:
            # moments of [0, host_end) on the host, the rest on the device (offset host_end)
            n, h = masters.num_trainable, masters.host_end
            pin = masters.device.type == "cuda"
            self.host_exp_avg = pinned_empty(h, torch.float32, pin=pin).zero_()
            self.host_exp_avg_sq = pinned_empty(h, torch.float32, pin=pin).zero_()
            self.exp_avg = torch.zeros(n - h, dtype=torch.float32, device=masters.device)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
            if h:
                dtype = masters.compute.dtype
                self._host_step = HostAdamW(masters.device, dtype, threads=host_threads)
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
        m, v = self._moments(start, end)
        return m.view_as(p), v.view_as(p)

    def _moments(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """The moments of masters ``[start, end)`` (on one side of ``host_end``)."""
        h = self.masters.host_end
        if end <= h:
            return self.host_exp_avg[start:end], self.host_exp_avg_sq[start:end]
        return self.exp_avg[start - h : end - h], self.exp_avg_sq[start - h : end - h]

    def _on_host(self, p: Tensor) -> bool:
        return self.masters.span(p)[1] <= self.masters.host_end

    @torch.no_grad()
    def _bind_state(self, *, fresh: bool) -> None:
        """Make every parameter's ``exp_avg`` / ``exp_avg_sq`` views of the flat buffers
        (``fresh``: zero moments at step 0; else copy in what a state dict load put there)."""
        for group in self.param_groups:
            for p in group["params"]:
                device = torch.device("cpu") if self._on_host(p) else self.masters.device
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

    def forget_grads(self) -> None:
        """Drop the cached per-parameter views of the gradient buffer (:meth:`grad_norm`'s):
        they would keep a buffer the masters released or moved alive on the device."""
        self._grad_views = (None, [])

    def to(self, device: torch.device) -> None:
        """Move the state (offload, onload) and re-point the per-parameter views."""
        self.forget_grads()
        if self._runs is None:
            _move_state_tensors(self, device)
            return
        self.exp_avg = self._host.move("exp_avg", self.exp_avg, device)
        self.exp_avg_sq = self._host.move("exp_avg_sq", self.exp_avg_sq, device)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not self._on_host(p):  # the host part's state stays where it is
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

        h = masters.host_end
        host: list[HostPiece] = []
        for group, (start, end) in zip(self.param_groups, self._runs, strict=True):
            on_host = [self.state[p]["step"] for p in group["params"] if self._on_host(p)]
            on_device = [self.state[p]["step"] for p in group["params"] if not self._on_host(p)]
            for steps in (on_host, on_device):
                if steps:
                    torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            if start < h:  # the group's host part: [start, min(end, h))
                top = min(end, h)
                m, v = self._moments(start, top)
                host.append(
                    HostPiece(
                        masters.master_slice(start, top),
                        m,
                        v,
                        on_host[0],
                        grad[start:top],
                        masters.compute[start:top],
                        lr=group["lr"],
                        weight_decay=group["weight_decay"],
                        beta1=beta1,
                        beta2=beta2,
                        eps=group["eps"],
                    )
                )
                start = top
            if start >= end:
                continue
            m, v = self._moments(start, end)
            if device.type == "cpu":  # torch's fused CPU kernel, with the group's own floats
                _fused_cpu(
                    masters.master_slice(start, end),
                    grad[start:end],
                    m,
                    v,
                    on_device[0],
                    group,
                    scale,
                )
                masters.compute[start:end].copy_(masters.master_slice(start, end))
                if single:
                    grad[start:end].zero_()
                continue
            update(
                masters.master_slice(start, end),
                grad[start:end],
                m,
                v,
                masters.compute[start:end],
                fill(group["lr"]),
                fill(group["weight_decay"]),
                fill(beta1),
                fill(beta2),
                fill(group["eps"]),
                on_device[0],
                scale,
                single,
            )
        if host:
            assert self._host_step is not None
            divide = None if self.grad_scale is None else float(self.grad_scale)
            self._host_step.step(host, divide)
            if single:  # the device update zeroed only its own part of the bf16 gradient
                grad[:h].zero_()
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


def _fused_cpu(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    group: dict,
    grad_scale: Tensor | None,
) -> None:
    """AdamW on a run of the flat buffers on the CPU: torch's fused CPU kernel, as
    ``torch.optim.AdamW(fused=True)`` calls it (the host step's kernel too)."""
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        [master],
        [grad.float() if grad.dtype != torch.float32 else grad.clone()],  # the kernel scales it
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=None,
    )


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
