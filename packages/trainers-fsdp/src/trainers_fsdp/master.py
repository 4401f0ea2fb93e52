"""One rank without FSDP: low-precision compute weights over float32 master weights and gradients.

In a world of one FSDP2 has nothing to shard but still works per parameter: every forward casts
and copies each parameter into its compute buffer in a Python loop, and every backward copies
each gradient into a reduce buffer. For the 2B model that is about 1,300 kernel launches and
tens of milliseconds of host time per step, which the GPU spends waiting (docs/performance.md).

:class:`MasterWeights` keeps the model's parameters as views into one flat bf16 buffer and their
float32 masters as views into another, as Megatron's mixed-precision optimizer does at
data-parallel size 1. The bf16 gradients accumulate (in place, by autograd) in a flat buffer
too, so moving a micro-batch's gradients into the float32 accumulator is one add, and
refreshing the compute weights after an optimizer step is one copy. The masters live in a
parameter-only module with the model's names (:attr:`MasterWeights.module`), so the optimizer,
gradient clipping and distributed checkpoints see ordinary float32 parameters under the names
an FSDP run would use.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def _named_module_tree(named: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """Empty modules nested by the dotted names, each holding its parameters."""
    root = nn.Module()
    for name, param in named:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, param)
    return root


class MasterWeights:
    """Flat float32 masters and gradients behind a model whose parameters are cast to ``dtype``.

    After construction ``model``'s parameters are ``dtype`` views of one buffer and every
    trainable one has a ``.grad`` view of a zeroed ``dtype`` gradient buffer, into which
    autograd accumulates. Per training step the caller runs, in order: backward, then
    :meth:`accumulate_grads` after each micro-batch; the optimizer over :attr:`module`'s
    parameters; :meth:`copy_to_model`; :meth:`zero_grad`.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        if dtype == torch.float32:
            raise ValueError("float32 compute needs no master weights: train the model directly")
        self.model = model
        named = list(model.named_parameters())  # a tied parameter once, under its first name
        self._params = [p for _, p in named]
        self._shapes = [p.shape for p in self._params]
        self._offsets = _offsets(p.numel() for p in self._params)
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        self._grad_offsets = dict(
            zip(trainable, _offsets(self._params[i].numel() for i in trainable)[:-1], strict=True)
        )
        total = self._offsets[-1]
        total_grad = sum(self._params[i].numel() for i in trainable)
        self.master = torch.empty(total, dtype=torch.float32, device=device)
        for p, (start, end) in zip(self._params, itertools.pairwise(self._offsets), strict=True):
            self.master[start:end].copy_(p.detach().reshape(-1))
        self.compute = self.master.to(dtype)
        self.grad = torch.zeros(total_grad, dtype=torch.float32, device=device)
        self.compute_grad = torch.zeros(total_grad, dtype=dtype, device=device)
        self._masters = [
            nn.Parameter(torch.empty(0), requires_grad=p.requires_grad) for p in self._params
        ]
        self.module = _named_module_tree(
            [(name, m) for (name, _), m in zip(named, self._masters, strict=True)]
        )
        self._bind()
        self._grad_empty = True  # self.grad holds nothing yet: the next accumulate copies
        logger.info(
            "master weights: %.1fM params (%.1fM trainable), %s compute, float32 masters",
            total / 1e6,
            total_grad / 1e6,
            str(dtype).removeprefix("torch."),
        )

    def _bind(self) -> None:
        """Point the model's and the masters' ``.data`` and ``.grad`` at the flat buffers."""
        for i, (p, m) in enumerate(zip(self._params, self._masters, strict=True)):
            start, end = self._offsets[i], self._offsets[i + 1]
            p.data = self.compute[start:end].view(self._shapes[i])
            m.data = self.master[start:end].view(self._shapes[i])
            if i in self._grad_offsets:
                g = self._grad_offsets[i]
                n = end - start
                p.grad = self.compute_grad[g : g + n].view(self._shapes[i])
                m.grad = self.grad[g : g + n].view(self._shapes[i])

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the bf16 gradients of the last backward to the float32 ones and zero them."""
        _on(self.grad.device, _move_grads)(self.grad, self.compute_grad, self._grad_empty)
        self._grad_empty = False

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Forget the accumulated gradients (lazily: the next accumulate overwrites them)."""
        self._grad_empty = True

    @torch.no_grad()
    def ready_grads(self) -> None:
        """Before reading the float32 gradients: zeros if nothing was accumulated."""
        if self._grad_empty:
            self.grad.zero_()
            self._grad_empty = False

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Cast the masters into the compute weights (after an optimizer step or a load)."""
        _on(self.compute.device, _cast_into)(self.compute, self.master)

    @contextlib.contextmanager
    def grads_detached(self) -> Iterator[None]:
        """The masters without ``.grad`` for a while. torch.distributed.checkpoint gives a
        fresh optimizer its state (by a zero-gradient step) only when no parameter has one."""
        for m in self._masters:
            m.grad = None
        try:
            yield
        finally:
            self._bind()

    def to(self, device: torch.device, *, fill: bool = True) -> None:
        """Move to ``device`` (offload, onload) and re-point every view at the new buffers.

        Only the float32 masters travel, and the float32 gradients while they hold an
        accumulated gradient. The bf16 weights are a cast of the masters and the bf16 gradient
        buffer is zero between micro-batches, so both are made afresh where they land: for
        the 2B model 8.5 GB cross each way instead of 25.5. ``fill=False`` leaves them
        unfilled (an offload: nothing runs until they come back)."""
        non_blocking = device.type != "cpu"
        self.master = self.master.to(device, non_blocking=non_blocking)
        if self._grad_empty:
            self.grad = torch.empty_like(self.grad, device=device)
        else:
            self.grad = self.grad.to(device, non_blocking=non_blocking)
        self.compute = torch.empty_like(self.compute, device=device)
        new_grad = torch.zeros_like if fill else torch.empty_like
        self.compute_grad = new_grad(self.compute_grad, device=device)
        if fill:
            self.copy_to_model()
        self._bind()

    def state_dict(self) -> dict[str, Tensor]:
        """``model.state_dict()`` with each parameter's float32 master in place of its
        compute weight (tied names included, as the model lists them)."""
        by_id = {id(p): m for p, m in zip(self._params, self._masters, strict=True)}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {
            name: by_id[id(params[name])].detach() if name in params else value
            for name, value in self.model.state_dict().items()
        }


def _move_grads(acc: Tensor, grad: Tensor, first: bool) -> None:
    if first:
        acc.copy_(grad)
    else:
        acc.add_(grad)
    grad.zero_()


def _cast_into(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src)


_compiled: dict = {}


def _on(device: torch.device, fn):
    """``fn`` as one compiled kernel on CUDA, eager elsewhere. aten's copy between dtypes runs
    an unvectorized kernel at about half the memory bandwidth; these passes touch every
    parameter, about 13 GB for the 2B model each."""
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _compiled[fn]


def _offsets(sizes: Iterable[int]) -> list[int]:
    """Start of each piece in a flat buffer, then the total."""
    return [0, *itertools.accumulate(sizes)]
