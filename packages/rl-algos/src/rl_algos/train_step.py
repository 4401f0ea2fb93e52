"""One optimizer step, written once for every trainer backend.

The step's logic lives here: batch validation, the loss denominators fixed over the whole
global batch, the scale of each micro-batch's loss, the metrics (declared with their
reduction, read from the device once per step) and skipping an update whose gradient norm is
not finite. A backend (``trainers_fsdp.FsdpActor``, ``trainers_megatron.MegatronActor``)
supplies only the :class:`TrainBackend` hooks::

    micro_batches(batch, fields)   -> micro-batches (len known up front, built as iterated)
    run_micro_batches(mbs, loss_fn, entropy=...)   forward each, loss_fn(mb, logprobs, entropy),
                                                   backward the value it returns; under its own
                                                   schedule (a plain loop, or a pipeline's)
    finish_grads()                 -> the gradient norm as a device tensor (after reducing)
    apply_update(grad_norm | None) -> the LR; clips and steps, or (None) drops the gradients

and, outside the step, log-probs, HF-named tensors, state dicts and moves to and from the GPU.

Loss scaling. Each micro-batch's loss is its own aggregate (mean over its loss tokens, or over
its samples) times ``units / total_units``, where ``units`` are its loss tokens (token-mean) or
samples (the sequence modes) and ``total_units`` the same count over all micro-batches of all
data-parallel ranks. Summing the gradients over micro-batches and ranks then gives the
gradient of the loss aggregated over the whole global batch. A backend whose gradient
reduction averages over ranks (FSDP) multiplies by its world size in its backward.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from rl_algos.losses import EntropyMode, TrainLoss
from rl_algos.metrics import Reduce, StepMetrics, all_reduce_, peak_rss_gib

logger = logging.getLogger(__name__)
#: a step's progress inside a trainer rank: rl-runtime's workers show it at INFO whatever their
#: level (`rl_runtime.workers.PROGRESS_LOGGER`)
progress_logger = logging.getLogger("glimpse.progress")
#: seconds between two micro-batch progress lines of one step (the first comes after as long)
PROGRESS_EVERY_S = 10.0

# What the step itself reports, besides the loss object's metrics.
STEP_METRICS: dict[str, Reduce] = {
    "loss": "sum",  # the global-batch loss: the scaled micro-batch losses, summed
    "loss_tokens": "sum",
    "tokens": "sum",
    "num_micro_batches": "max",  # per rank (ranks may differ): the largest
}

# loss_fn(micro_batch, logprobs [T], entropy [T] | None) -> the value to backward (scalar)
MicroBatchLoss = Callable[[Any, Tensor, Tensor | None], Tensor]


@runtime_checkable
class TrainBackend(Protocol):
    """What a trainer backend supplies to :func:`train_step` (see the module docstring).

    ``group``: the process group the step's samples are split over (data parallel; ``None``
    for all ranks); metrics and denominators are reduced over it. Ranks that hold the same
    samples (tensor or pipeline parallel peers) are not in it. ``step``: optimizer steps taken.
    """

    device: torch.device
    group: Any
    step: int

    def micro_batches(self, batch: Any, fields: Sequence[str]) -> Sequence[Any]: ...

    def run_micro_batches(
        self, micro_batches: Sequence[Any], loss_fn: MicroBatchLoss, *, entropy: EntropyMode
    ) -> None: ...

    def finish_grads(self) -> Tensor: ...

    def apply_update(self, grad_norm: float | None) -> float: ...


class MicroBatchProgress:
    """``train: micro-batch 3/8 after 21.0 s``, at most every ``every_s`` seconds: a long step
    shows that it moves and how far it is, a short one stays silent. Called once per
    micro-batch, after its forward. ``shown``: whether this rank logs (one rank per step)."""

    def __init__(self, total: int, *, shown: bool, every_s: float = PROGRESS_EVERY_S) -> None:
        self.total, self.shown, self.every_s = total, shown, every_s
        self.done = 0
        self.start = self.last = time.perf_counter()

    def __call__(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.shown and now - self.last >= self.every_s:
            self.last = now
            progress_logger.info(
                "train: micro-batch %d/%d after %.1f s", self.done, self.total, now - self.start
            )


def reports_progress(backend: Any) -> bool:
    """Whether ``backend``'s rank logs the step's progress: its own say
    (``reports_progress``: Megatron's loss is on the last pipeline stage), else rank 0."""
    own = getattr(backend, "reports_progress", None)
    if own is not None:
        return bool(own)
    return not dist.is_initialized() or dist.get_rank() == 0


class MicroBatches:
    """Micro-batches built as they are iterated, so a backend's host work (packing, the copy
    to the device) overlaps the GPU's work on the previous one; their count is known up front
    (``len``), as a pipeline schedule needs it. Iterated once per step."""

    def __init__(self, plan: Sequence[Sequence[int]], build: Callable[[Sequence[int]], Any]):
        self.plan = list(plan)
        self.build = build

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self):
        return (self.build(indices) for indices in self.plan)


def run_sequentially(
    micro_batches: Iterable[Any],
    forward: Callable[[Any], tuple[Tensor, Tensor | None]],
    backward: Callable[[Tensor], None],
    loss_fn: MicroBatchLoss,
) -> None:
    """The plain schedule: forward, loss, backward, one micro-batch after the other."""
    for mb in micro_batches:
        logprobs, entropy = forward(mb)
        backward(loss_fn(mb, logprobs, entropy))


def loss_units(loss_tokens: Sequence[int], mode: str) -> float:
    """What a loss of aggregation ``mode`` averages over, from per-sample loss-token counts:
    tokens (``token-mean``), samples with a loss token (``seq-mean-token-mean``) or samples
    (``seq-mean-token-sum-norm``); as :func:`rl_algos.loss_denominator` on the masks."""
    if mode == "token-mean":
        return float(sum(loss_tokens))
    if mode == "seq-mean-token-mean":
        return float(sum(1 for n in loss_tokens if n > 0))
    if mode == "seq-mean-token-sum-norm":
        return float(len(loss_tokens))
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def accumulate(
    backend: TrainBackend,
    batch: Any,
    loss: TrainLoss,
    *,
    log_entropy: bool = False,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> StepMetrics:
    """Forward and backward over ``batch`` (this rank's part of the global batch), adding the
    global-batch loss's gradient to the backend's; the metrics stay on the device. A step
    longer than ``progress_every_s`` logs its micro-batch progress (`MicroBatchProgress`)."""
    loss.check(batch)
    device, group = backend.device, backend.group
    counts = [int((m > 0).sum()) for m in batch.loss_mask]
    mode = loss.agg_mode
    if mode == "seq-mean-token-sum-norm" and loss.norm_length is None:
        # the longest response of the global batch, the same constant on every rank
        longest = torch.tensor([float(max(counts, default=0))], device=device)
        all_reduce_(longest, dist.ReduceOp.MAX, group)
        loss = loss.with_norm_length(max(1.0, float(longest.item())))
    # stays on the device: each micro-batch's scale is a device division, no host read
    total_units = torch.full((), loss_units(counts, mode), dtype=torch.float64, device=device)
    all_reduce_(total_units, group=group)
    total_units = total_units.clamp(min=1.0)

    metrics = StepMetrics({**loss.metrics, **STEP_METRICS}, device)
    micro_batches = backend.micro_batches(batch, loss.fields)
    progress = MicroBatchProgress(
        len(micro_batches), shown=reports_progress(backend), every_s=progress_every_s
    )

    def micro_loss(mb: Any, logprobs: Tensor, entropy: Tensor | None) -> Tensor:
        progress()
        if not mb.indices:  # a filler micro-batch: forward and backward for the collectives
            return logprobs.sum() * 0.0
        n = mb.num_real_tokens
        value, values = loss(
            logprobs[:n], mb.fields, mb.real_cu_seqlens, None if entropy is None else entropy[:n]
        )
        scale = (loss_units(mb.loss_tokens, mode) / total_units).to(value.dtype)
        scaled = value * scale
        metrics.add("loss", scaled)
        metrics.update(values, weight=float(sum(mb.loss_tokens)))
        return scaled

    backend.run_micro_batches(micro_batches, micro_loss, entropy=loss.entropy_mode(log_entropy))
    metrics.add("loss_tokens", float(sum(counts)))
    metrics.add("tokens", float(sum(len(t) for t in batch.input_ids)))
    metrics.add("num_micro_batches", float(len(micro_batches)))
    return metrics


def apply_update(backend: TrainBackend, grad_norm: float) -> dict[str, float]:
    """The backend's update, or none for a non-finite gradient norm (its gradients dropped,
    its LR schedule left where it is); counts the step."""
    skipped = not math.isfinite(grad_norm)
    if skipped:
        logger.warning("step %d: non-finite grad norm %s, update skipped", backend.step, grad_norm)
    start = time.perf_counter()
    lr = backend.apply_update(None if skipped else grad_norm)
    backend.step += 1
    return {
        "grad_norm": grad_norm,
        "lr": lr,
        "step": float(backend.step),
        "update_skipped": float(skipped),
        # the host's time in the update: all of it where the optimizer steps on the host (the
        # backend waits for its copies back), the launch only where the GPU steps it (queued)
        "perf/optimizer_s": time.perf_counter() - start,
        # the rank's peak resident host memory: where a trainer fills the host (an H200 run of
        # the 30B-A3B cut on FSDP was killed at 113.7 GiB in its first step), the step says so
        "perf/host_peak_gib": peak_rss_gib(),
    }


def train_step(
    backend: TrainBackend, batch: Any, loss: TrainLoss, *, log_entropy: bool = False
) -> dict[str, float]:
    """One optimizer step over the global batch (``batch``: this rank's part); metrics are
    global. The host reads the device once, after the backward: the metrics and the gradient
    norm in one transfer. The update is then queued without waiting for it."""
    start = time.perf_counter()
    metrics = accumulate(backend, batch, loss, log_entropy=log_entropy)
    values = metrics.read(backend.group, extra={"grad_norm": backend.finish_grads()})
    out = {**values, **apply_update(backend, values.pop("grad_norm"))}
    elapsed = time.perf_counter() - start
    # the trainer's own step (a GRPO step's is the loop's perf/grpo_step_s)
    out.update({"perf/train_step_s": elapsed, "tokens_per_s": out["tokens"] / elapsed})
    return out


def forward_backward(
    backend: TrainBackend, batch: Any, loss: TrainLoss, *, log_entropy: bool = False
) -> dict[str, float]:
    """:func:`train_step`'s first half: accumulate the gradient, read the metrics."""
    return accumulate(backend, batch, loss, log_entropy=log_entropy).read(backend.group)


def optimizer_step(backend: TrainBackend) -> dict[str, float]:
    """:func:`train_step`'s second half: finish the gradients and update (or skip)."""
    return apply_update(backend, float(backend.finish_grads()))


def collect_logprobs(
    micro_batches: Iterable[Any], forward: Callable[[Any], Tensor], num_samples: int
) -> list[Tensor]:
    """Per-sample log-probs ``[L_i]`` (float32, CPU) from ``forward(mb) -> [T]`` over packed
    micro-batches."""
    out: list[Tensor | None] = [None] * num_samples
    for mb in micro_batches:
        logprobs = forward(mb).float().cpu()
        real = logprobs[: mb.num_real_tokens].split(mb.lengths[: len(mb.indices)])
        for i, part in zip(mb.indices, real, strict=True):
            out[i] = part
    return out  # type: ignore[return-value]
