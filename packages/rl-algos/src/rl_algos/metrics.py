"""Step metrics declared once with their reduction, kept on the device, read once per step.

A trainer step produces scalars per micro-batch (a loss's clip fraction, the largest ratio,
the step's loss share). Reading each from the GPU (``.item()``) would wait for the GPU every
micro-batch; :class:`StepMetrics` instead keeps running sums and extremes as device tensors,
reduces them over the data-parallel ranks with one all-reduce per kind (sum, max) and reads
everything, plus any extra scalars such as the gradient norm, in one transfer.

Reductions (over micro-batches and then ranks):

- ``"mean"``: weighted mean; the weight is what the caller passes (a trainer passes the
  micro-batch's loss-token count, so the result is the mean over the step's loss tokens).
- ``"sum"``: plain sum.
- ``"min"`` / ``"max"``: extremes.

A metric no rank produced in a step is left out of the result.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

Reduce = Literal["sum", "mean", "min", "max"]
REDUCTIONS: tuple[str, ...] = get_args(Reduce)


def all_reduce_(tensor: Tensor, op=dist.ReduceOp.SUM, group=None) -> Tensor:
    """In-place all-reduce over ``group``; nothing to do without a process group or alone."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


class StepMetrics:
    """Running metrics of one step, on ``device``.

    Example::

        metrics = StepMetrics({"loss": "sum", "clip_frac": "mean", "ratio_max": "max"}, device)
        for mb in micro_batches:
            metrics.add("loss", scaled_loss.detach())
            metrics.update(loss_metrics, weight=loss_tokens)
        out = metrics.read(group=dp_group, extra={"grad_norm": norm})  # the one host sync
    """

    def __init__(self, specs: Mapping[str, Reduce], device: torch.device | str) -> None:
        for name, reduce in specs.items():
            if reduce not in REDUCTIONS:
                raise ValueError(f"metric {name!r}: reduction must be one of {REDUCTIONS}")
        self.specs = dict(specs)
        self.device = torch.device(device)
        self._values: dict[str, Tensor] = {}  # sum / weighted sum / extreme (min negated)
        self._weights: dict[str, float] = {}  # mean: total weight; others: times added

    def _fill(self, value: float) -> Tensor:
        # a fill, not torch.tensor(x, device=...): the latter copies from pageable host memory,
        # which waits for the GPU
        return torch.full((), value, dtype=torch.float64, device=self.device)

    def add(self, name: str, value: Tensor | float, weight: float = 1.0) -> None:
        """Fold one micro-batch's ``value`` (a scalar tensor or number) into ``name``."""
        try:
            reduce = self.specs[name]
        except KeyError:
            raise ValueError(
                f"metric {name!r} is not declared; declared: {sorted(self.specs)}"
            ) from None
        v = value.detach().to(self.device, torch.float64) if isinstance(value, Tensor) else None
        if v is None:
            v = self._fill(float(value))
        old = self._values.get(name)
        if reduce == "mean":
            v = v * weight
            self._values[name] = v if old is None else old + v
            self._weights[name] = self._weights.get(name, 0.0) + weight
            return
        if reduce == "min":
            v = -v
        if reduce == "sum":
            self._values[name] = v if old is None else old + v
        else:
            self._values[name] = v if old is None else torch.maximum(old, v)
        self._weights[name] = self._weights.get(name, 0.0) + 1.0

    def update(self, values: Mapping[str, Tensor | float], weight: float = 1.0) -> None:
        """:meth:`add` for each item (``weight`` applies to the ``"mean"`` ones)."""
        for name, value in values.items():
            self.add(name, value, weight)

    def read(self, group=None, extra: Mapping[str, Tensor | float] = {}) -> dict[str, float]:
        """Reduce over the ranks of ``group`` (collective) and read, with ``extra`` scalars
        (as they are, not reduced), in one device-to-host transfer."""
        names = sorted(self.specs)  # the same order on every rank: the specs are the same
        summed = [n for n in names if self.specs[n] in ("sum", "mean")]
        extreme = [n for n in names if n not in summed]
        zero, low = self._fill(0.0), self._fill(-float("inf"))
        sum_vec = torch.stack(
            [self._values.get(n, zero) for n in summed]
            + [self._fill(self._weights.get(n, 0.0)) for n in names]
        )
        max_vec = torch.stack([self._values.get(n, low) for n in extreme] + [zero])
        all_reduce_(sum_vec, group=group)
        all_reduce_(max_vec, dist.ReduceOp.MAX, group=group)
        extras = [
            torch.as_tensor(v).to(self.device, torch.float64).reshape(1) for v in extra.values()
        ]
        values = torch.cat([sum_vec, max_vec, *extras]).tolist()
        sums = dict(zip(summed, values, strict=False))
        counts = dict(zip(names, values[len(summed) :], strict=False))
        rest = values[len(summed) + len(names) :]
        extremes = dict(zip(extreme, rest, strict=False))
        out: dict[str, float] = {}
        for n in names:
            if counts[n] == 0:
                continue  # produced by no micro-batch of any rank
            reduce = self.specs[n]
            if reduce == "mean":
                out[n] = sums[n] / counts[n] if counts[n] > 0 else 0.0
            elif reduce == "sum":
                out[n] = sums[n]
            else:
                out[n] = extremes[n] if reduce == "max" else -extremes[n]
        out.update(zip(extra, rest[len(extreme) + 1 :], strict=True))
        return out


def peak_rss_gib() -> float:
    """This process's peak resident host memory so far, in GiB (``getrusage``'s ``ru_maxrss``:
    KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
