"""AdamW on float32 masters and moments kept in host memory, from gradients on the device.

The host half of both trainers' ``--optimizer-cpu-offload``: the FSDP flat masters'
(:class:`trainers_fsdp.flat_adamw.FlatAdamW` hands it runs of its pinned host masters) and
megatron-core's HybridDeviceOptimizer's (:mod:`trainers_megatron.host_step` hands it the host
copies that optimizer owns, in place of its own per-parameter step). Only the optimizer step
needs the host; the bf16 compute weights and the gradients stay on the GPU.

The step goes piece by piece (``CHUNK`` elements): the gradient piece (bf16 after one
micro-batch, else the float32 accumulator) is copied into a pinned float32 buffer on a copy
stream; torch's fused CPU AdamW (``aten::_fused_adamw_``, the kernel of
``torch.optim.AdamW(fused=True)`` on the CPU) updates masters and moments in place, on every
core the process may use (``trainer_core.host_threads``); the new masters are cast into a
pinned bf16 buffer and copied into the device weights on a second stream. Two buffers of each
kind alternate, so the next piece's gradient and the last piece's weights cross PCIe while the
CPU steps this one. On the CPU (tests) the same arithmetic runs with plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer_core.host_memory import CHUNK
from trainer_core.offload import host_threads


@dataclass
class HostPiece:
    """One contiguous run of host-resident masters and its gradient and weights on the device."""

    master: Tensor  # float32, host
    exp_avg: Tensor  # float32, host
    exp_avg_sq: Tensor  # float32, host
    step: Tensor  # float32 scalar on the host, already counted for this step
    grad: Tensor  # the device's gradient of the same elements (bf16 or float32)
    weights: Tensor  # the device's compute weights of the same elements
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float


class HostAdamW:
    """Steps :class:`HostPiece` runs (see the module docstring); buffers are made once."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, *, chunk: int = CHUNK, threads=None
    ) -> None:
        self.device, self.dtype, self.chunk, self.threads = device, dtype, chunk, threads
        self._cuda = device.type == "cuda"
        self._grads: list[Tensor] = []
        self._weights: list[Tensor] = []
        self._streams = (
            (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self._cuda else None
        )

    def _buffers(self, size: int) -> None:
        if self._grads and self._grads[0].numel() >= size:
            return
        pin = self._cuda
        self._grads = [torch.empty(size, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._weights = [torch.empty(size, dtype=self.dtype, pin_memory=pin) for _ in range(2)]

    @torch.no_grad()
    def step(self, pieces: Sequence[HostPiece], grad_scale: float | None) -> None:
        """AdamW on every piece with the gradients divided by ``grad_scale`` (None: as they
        are); returns when the new weights are on the device."""
        work = [
            (piece, a, min(a + self.chunk, piece.master.numel()))
            for piece in pieces
            for a in range(0, piece.master.numel(), self.chunk)
        ]
        if not work:
            return
        self._buffers(max(b - a for _, a, b in work))
        scale = None if grad_scale is None else torch.tensor(grad_scale, dtype=torch.float32)
        arrived: list = [None, None]
        landed: list = [None, None]
        if self._streams is not None:
            for stream in self._streams:  # the gradients are the backward's, on this stream
                stream.wait_stream(torch.cuda.current_stream(self.device))

        def fetch(i: int) -> None:
            piece, a, b = work[i]
            buf = self._grads[i % 2][: b - a]
            if self._streams is None:
                buf.copy_(piece.grad[a:b])
                return
            with torch.cuda.stream(self._streams[0]):
                buf.copy_(piece.grad[a:b], non_blocking=True)
                arrived[i % 2] = self._streams[0].record_event()

        fetch(0)
        with host_threads(self.threads):
            for i, (piece, a, b) in enumerate(work):
                k = i % 2
                if i + 1 < len(work):
                    fetch(i + 1)  # its buffer's last reader, piece i - 1, is done
                if arrived[k] is not None:
                    arrived[k].synchronize()
                torch._fused_adamw_(
                    [piece.master[a:b]],
                    [self._grads[k][: b - a]],
                    [piece.exp_avg[a:b]],
                    [piece.exp_avg_sq[a:b]],
                    [],
                    [piece.step],
                    lr=piece.lr,
                    beta1=piece.beta1,
                    beta2=piece.beta2,
                    weight_decay=piece.weight_decay,
                    eps=piece.eps,
                    amsgrad=False,
                    maximize=False,
                    grad_scale=scale,
                    found_inf=None,
                )
                if landed[k] is not None:
                    landed[k].synchronize()  # piece i - 2's weights have left this buffer
                out = self._weights[k][: b - a]
                out.copy_(piece.master[a:b])
                if self._streams is None:
                    piece.weights[a:b].copy_(out)
                    continue
                with torch.cuda.stream(self._streams[1]):
                    piece.weights[a:b].copy_(out, non_blocking=True)
                    landed[k] = self._streams[1].record_event()
        if self._streams is not None:
            for event in landed:
                if event is not None:
                    event.synchronize()
            for stream in self._streams:
                torch.cuda.current_stream(self.device).wait_stream(stream)
