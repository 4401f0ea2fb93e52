"""One rank without FSDP: low-precision compute weights over float32 master weights and gradients.

In a world of one FSDP2 has nothing to shard but still works per parameter: every forward casts
and copies each parameter into its compute buffer in a Python loop, and every backward copies
each gradient into a reduce buffer. For the 2B model that is about 1,300 kernel launches and
tens of milliseconds of host time per step, which the GPU spends waiting (docs/performance.md).

:class:`MasterWeights` keeps the model's parameters as views into one flat bf16 buffer and their
float32 masters as views into another, as Megatron's mixed-precision optimizer does at
data-parallel size 1. The bf16 gradients accumulate (in place, by autograd) in a flat buffer
too. A micro-batch's bf16 gradient moves into the float32 accumulator (one add) only when
another backward is about to start, so a step of one micro-batch never needs the float32
gradient: :class:`trainers_fsdp.flat_adamw.FlatAdamW` reads the bf16 one directly and writes
the masters, AdamW's moments and the bf16 weights in one pass. The masters live in a
parameter-only module with the model's names (:attr:`MasterWeights.module`), so the optimizer,
gradient clipping and distributed checkpoints see ordinary float32 parameters under the names
an FSDP run would use.

With ``host_fraction`` > 0 (the launchers' ``--optimizer-cpu-offload``) the masters of the
first trainable parameters, that fraction of the trainable elements, live in pinned host
memory instead (:attr:`MasterWeights.host_master`, offsets ``[0, host_end)``); their AdamW step
runs there too (:mod:`trainer_core.host_adamw`). The bf16 weights and gradients stay on the
device.

Between steps the gradient buffers hold nothing (an optimizer step leaves them zero), yet they
are a third of the state: 6 of the 20 bytes per parameter. :meth:`MasterWeights.release_grads`
frees both while a colocated engine generates (the actor's ``release_cache``), and the next
backward makes the bf16 one again (zeroed) and the next accumulation the float32 one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from trainer_core import HostCopies, pinned_empty
from trainer_core.host_memory import CHUNK
from trainers_fsdp.distributed import all_reduce_mean_

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
    autograd accumulates. The flat layout puts the trainable matrices first, then the trainable
    vectors, then frozen parameters, so each of the optimizer's groups (decay on matrices only,
    :func:`trainers_fsdp.optim.build_optimizer`) is one contiguous run of every buffer.

    Per training step the caller runs :meth:`before_backward` before each micro-batch's
    backward, then either :class:`~trainers_fsdp.flat_adamw.FlatAdamW` (which does the rest)
    or :meth:`ready_grads`, an optimizer over :attr:`module`'s parameters,
    :meth:`copy_to_model` and :meth:`zero_grad`.
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        *,
        host_fraction: float = 0.0,
    ) -> None:
        if dtype == torch.float32:
            raise ValueError("float32 compute needs no master weights: train the model directly")
        if not 0.0 <= host_fraction <= 1.0:
            raise ValueError(f"host_fraction must be within [0, 1], got {host_fraction}")
        self.model = model
        named = list(model.named_parameters())  # a tied parameter once, under its first name
        layout = sorted(named, key=lambda item: (not item[1].requires_grad, item[1].dim() < 2))
        self._params = [p for _, p in layout]
        self._shapes = [p.shape for p in self._params]
        self._offsets = _offsets(p.numel() for p in self._params)
        self.num_trainable = sum(p.numel() for p in self._params if p.requires_grad)
        total = self._offsets[-1]
        self.host_end = _split(self._offsets, self.num_trainable, host_fraction)
        pin = device.type == "cuda"
        # masters [0, host_end) on the host, [host_end, total) on the device (offset host_end)
        self.host_master = pinned_empty(self.host_end, torch.float32, pin=pin)
        self.master = torch.empty(total - self.host_end, dtype=torch.float32, device=device)
        for p, (start, end) in zip(self._params, itertools.pairwise(self._offsets), strict=True):
            self.master_slice(start, end).copy_(p.detach().reshape(-1))
        self.compute = torch.empty(total, dtype=dtype, device=device)
        # the bf16 gradient autograd accumulates into; None once released (release_grads)
        self.compute_grad: Tensor | None = torch.zeros(
            self.num_trainable, dtype=dtype, device=device
        )
        # float32 accumulator, allocated by the first move into it: a step of one micro-batch
        # (FlatAdamW) never needs it
        self.grad: Tensor | None = None
        self._masters = [
            nn.Parameter(torch.empty(0), requires_grad=p.requires_grad) for p in self._params
        ]
        by_id = {id(p): m for p, m in zip(self._params, self._masters, strict=True)}
        self.module = _named_module_tree([(name, by_id[id(p)]) for name, p in named])
        self._spans = {
            id(m): (self._offsets[i], self._offsets[i + 1]) for i, m in enumerate(self._masters)
        }
        self._host = HostCopies()
        self.copy_to_model()
        self._bind()
        self._pending = False  # compute_grad may hold a backward's gradient not yet in grad
        self._grad_empty = True  # grad holds nothing yet: the next move copies
        logger.info(
            "master weights: %.1fM params (%.1fM trainable), %s compute, float32 masters "
            "(%.1fM on the host)",
            total / 1e6,
            self.num_trainable / 1e6,
            str(dtype).removeprefix("torch."),
            self.host_end / 1e6,
        )

    def span(self, master: nn.Parameter) -> tuple[int, int]:
        """Where a master parameter of :attr:`module` lies in the flat buffers."""
        return self._spans[id(master)]

    def master_slice(self, start: int, end: int) -> Tensor:
        """The masters ``[start, end)`` (flat offsets): a view of :attr:`host_master` or of
        :attr:`master`; a range never crosses ``host_end`` (a parameter boundary)."""
        if end <= self.host_end:
            return self.host_master[start:end]
        if start < self.host_end:
            raise ValueError(f"[{start}, {end}) crosses the host part's end {self.host_end}")
        return self.master[start - self.host_end : end - self.host_end]

    def _bind(self) -> None:
        """Point the model's and the masters' ``.data`` and ``.grad`` at the flat buffers
        (no ``.grad`` while the gradient buffers are released)."""
        for i, (p, m) in enumerate(zip(self._params, self._masters, strict=True)):
            start, end = self._offsets[i], self._offsets[i + 1]
            p.data = self.compute[start:end].view(self._shapes[i])
            m.data = self.master_slice(start, end).view(self._shapes[i])
            if p.requires_grad:  # trainable parameters come first: the same offsets
                grad = self.compute_grad
                p.grad = None if grad is None else grad[start:end].view(self._shapes[i])
        self._bind_master_grads()

    def _bind_master_grads(self) -> None:
        if self.grad is None:
            for m in self._masters:
                m.grad = None
            return
        for i, (p, m) in enumerate(zip(self._params, self._masters, strict=True)):
            if p.requires_grad:
                start, end = self._offsets[i], self._offsets[i + 1]
                # the host part's masters step from the flat gradient, read in pieces
                # (trainer_core.host_adamw): a device gradient cannot be a host tensor's .grad
                on_host = end <= self.host_end and self.grad.device != self.host_master.device
                m.grad = None if on_host else self.grad[start:end].view(self._shapes[i])

    @torch.no_grad()
    def before_backward(self) -> None:
        """A backward is about to add into the bf16 gradients: move what they hold first, so
        micro-batches sum in float32 (after :meth:`release_grads`, make the buffer again)."""
        self._flush()
        if self.compute_grad is None:
            self.compute_grad = torch.zeros(
                self.num_trainable, dtype=self.compute.dtype, device=self.device
            )
            self._bind()
        self._pending = True

    @property
    def grads_held(self) -> bool:
        """Whether a gradient is accumulated (a backward since the last step or zero_grad)."""
        return self._pending or not self._grad_empty

    @torch.no_grad()
    def release_grads(self) -> bool:
        """Free the bf16 and float32 gradient buffers when they hold nothing (between steps:
        what a colocated engine may use while it generates); the next backward makes them
        again. An accumulated gradient is kept (returns False)."""
        if self.grads_held:
            return False
        self.compute_grad = self.grad = None
        self._bind()
        return True

    @torch.no_grad()
    def _flush(self) -> None:
        """Move a pending bf16 gradient into the float32 accumulator and zero it."""
        if not self._pending:
            return
        grad = self._float32_grad()
        assert self.compute_grad is not None  # a backward wrote it (before_backward made it)
        compiled_on(self.device, _move_grads)(grad, self.compute_grad, self._grad_empty)
        self._pending, self._grad_empty = False, False

    @property
    def device(self) -> torch.device:
        return self.master.device

    def single_grad(self) -> Tensor | None:
        """The accumulated gradient when it is one backward's, still in ``dtype`` (read it
        directly instead of moving it), else None."""
        return self.compute_grad if self._pending and self._grad_empty else None

    @torch.no_grad()
    def ready_grads(self) -> Tensor:
        """The float32 gradient, everything accumulated moved into it (zeros if nothing)."""
        self._flush()
        if self._grad_empty:
            self._float32_grad().zero_()
            self._grad_empty = False
        return self.grad

    @torch.no_grad()
    def all_reduce_grads(self, reduce_dtype: torch.dtype) -> None:
        """Average the accumulated gradient over all ranks (replicated data parallel): the
        compute-dtype buffer itself when it holds one backward and ``reduce_dtype`` is its
        dtype, else the float32 accumulator (everything moved into it first). Every rank must
        take the same branch: the actor runs as many backwards on each (``plan_micro_batches``
        gives every rank the same count)."""
        grad = self.single_grad() if reduce_dtype == self.compute.dtype else None
        all_reduce_mean_(self.ready_grads() if grad is None else grad)

    def _float32_grad(self) -> Tensor:
        """The float32 accumulator (unfilled when new), bound as the masters' ``.grad``."""
        if self.grad is None:
            self.grad = torch.empty(self.num_trainable, dtype=torch.float32, device=self.device)
            self._bind_master_grads()
        return self.grad

    @torch.no_grad()
    def zero_grad(self, *, compute_grad_zeroed: bool = False) -> None:
        """Forget the accumulated gradients (the float32 ones lazily: the next move overwrites
        them). ``compute_grad_zeroed``: the caller already zeroed the bf16 buffer."""
        if self._pending and not compute_grad_zeroed and self.compute_grad is not None:
            self.compute_grad.zero_()
        self._pending, self._grad_empty = False, True

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Cast the masters into the compute weights (after an optimizer step or a load)."""
        if self.master.numel():
            compiled_on(self.device, _cast_into)(self.compute[self.host_end :], self.master)
        if self.host_end:
            cast_to_device(self.compute[: self.host_end], self.host_master)

    @contextlib.contextmanager
    def grads_detached(self) -> Iterator[None]:
        """The masters without ``.grad`` for a while. torch.distributed.checkpoint gives a
        fresh optimizer its state (by a zero-gradient step) only when no parameter has one."""
        for m in self._masters:
            m.grad = None
        try:
            yield
        finally:
            self._bind_master_grads()

    def to(self, device: torch.device, *, fill: bool = True) -> None:
        """Move to ``device`` (offload, onload) and re-point every view at the new buffers.

        Only the float32 masters travel, and the float32 gradients while they hold an
        accumulated gradient (a pending bf16 one is moved into them first). The bf16 weights
        are a cast of the masters and the bf16 gradient buffer is then zero, so both are made
        afresh where they land: for the 2B model 8.5 GB cross each way instead of 25.5.
        ``fill=False`` leaves them unfilled (an offload: nothing runs until they come back)."""
        self._flush()
        # offloads land in pinned host buffers reused from one offload to the next
        # (trainer_core.HostCopies: no pageable allocation and page faults every step); the
        # host part of the masters stays where it is
        self.master = self._host.move("master", self.master, device)
        if self.grad is not None:
            if self._grad_empty:
                self.grad = torch.empty_like(self.grad, device=device)
            else:
                self.grad = self._host.move("grad", self.grad, device)
        self.compute = torch.empty_like(self.compute, device=device)
        if self.compute_grad is not None:  # (released: made again by the next backward)
            new_grad = torch.zeros_like if fill else torch.empty_like
            self.compute_grad = new_grad(self.compute_grad, device=device)
        if fill:
            self.copy_to_model()
        self._bind()

    def take_moved(self) -> int:
        """Bytes the moves copied since the last call (the transfer rate's numerator)."""
        return self._host.take_moved()

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


def compiled_on(device: torch.device, fn):
    """``fn`` as one compiled kernel on CUDA, eager elsewhere. aten's copy between dtypes runs
    an unvectorized kernel at about half the memory bandwidth; these passes touch every
    parameter, about 13 GB for the 2B model each.

    Without autotuning: to time its configurations inductor first copies every buffer the
    kernel writes, into pinned host memory when the GPU has no room for clones
    (``copy_args_to_cpu_if_needed``), rounded up to powers of two and kept by torch's host
    cache. On the H200 (2026-12-04) that stopped the 8B run at its first accumulated
    micro-batch (no memory for a copy of the 35 GB float32 accumulator), and it fits the
    30B-A3B cut's FSDP trainer that grew to 113.7 GiB of host memory in its first train step
    (masters, moments and gradients of 6.1B parameters). One pass over memory gains nothing
    from a tuned block size."""
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        options = {"triton.autotune_pointwise": False}
        _compiled[fn] = torch.compile(fn, dynamic=False, fullgraph=True, options=options)
    return _compiled[fn]


def _split(offsets: list[int], trainable: int, fraction: float) -> int:
    """The end of the host part: the first parameter boundary at or past ``fraction`` of the
    trainable elements (all of them for 1, none for 0)."""
    if fraction <= 0:
        return 0
    goal = fraction * trainable
    return next((o for o in offsets if o >= goal and o <= trainable), trainable)


@torch.no_grad()
def cast_to_device(dst: Tensor, src: Tensor, chunk: int = CHUNK) -> None:
    """``dst.copy_(src)`` from a large host buffer to the device in pieces, so that the cast's
    temporary is a piece, not the whole buffer."""
    for start in range(0, src.numel(), chunk):
        dst[start : start + chunk].copy_(src[start : start + chunk])


def _offsets(sizes: Iterable[int]) -> list[int]:
    """Start of each piece in a flat buffer, then the total."""
    return [0, *itertools.accumulate(sizes)]
