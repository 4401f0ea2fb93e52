"""Micro-batches: samples of a TrainBatch packed end to end to a token budget, without padding.

Each micro-batch is one row of ``T`` tokens holding whole samples; every sample keeps its own
M-RoPE positions (``vlm_models.packed_position_ids``) and its attention stays inside its own
span (``PackedSeqInfo``). Under FSDP every rank must run the same number of forwards, and the
vision tower must run on every rank in each of them (its blocks all-gather their parameters),
so :func:`plan_micro_batches` agrees on a count across ranks and :func:`build_micro_batch`
appends a one-image dummy sample (never in the loss) where a micro-batch has no image.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import Tensor
from transformers import PretrainedConfig

from rl_algos import LossAggMode, TrainBatch, loss_denominator, pack_by_token_budget
from trainers_fsdp.distributed import all_reduce_
from vlm_models import packed_position_ids

logger = logging.getLogger(__name__)

_PER_TOKEN = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclass
class MicroBatch:
    """One packed row. Real samples come first; a dummy sample, when present, is last."""

    indices: list[int]  # sample indices into the TrainBatch (real samples only)
    lengths: list[int]  # token count of each packed sample, dummy included
    input_ids: Tensor  # LongTensor[T]
    position_ids: Tensor  # LongTensor[4, T]: text positions, then M-RoPE (t, h, w)
    # FloatTensor[P, D], all images of the row; per-sample parts until moved (the concatenation
    # then happens on the device, not as a large host copy)
    pixel_values: Tensor | list[Tensor] | None
    image_grid_thw: Tensor | None  # LongTensor[n_img, 3]
    fields: dict[str, Tensor]  # per-token training fields over the real tokens, [T_real]
    has_dummy: bool
    loss_units: dict[str, float]  # loss tokens / samples with tokens / samples, per agg mode
    loss_positions: Tensor  # LongTensor[R]: loss tokens that have a predecessor in their sample
    # the vision tower's precomputed inputs (trainers_fsdp.vision.VisionInputs), or None
    vision_inputs: dict[str, Any] | None = None

    @property
    def num_real_tokens(self) -> int:
        return sum(self.lengths[: len(self.indices)])

    @property
    def real_cu_seqlens(self) -> list[int]:
        cu = [0]
        for n in self.lengths[: len(self.indices)]:
            cu.append(cu[-1] + n)
        return cu

    def to(self, device: torch.device, staging: PinnedStaging | None = None) -> MicroBatch:
        """The same micro-batch on ``device``: asynchronous copies from pinned host memory.

        The pixels are concatenated on the host straight into pinned memory: into ``staging``'s
        reused buffers when given, else a one-off pinned buffer. With precomputed vision inputs
        ``image_grid_thw`` stays on the host: the model then reads it only as a list (its split
        sizes), which from a device tensor is a sync."""
        move = lambda t: None if t is None else to_device(t, device)  # noqa: E731
        pixels = self.pixel_values
        if isinstance(pixels, list) and device.type == "cuda":
            pixels = (staging or PinnedStaging(slots=1)).copy_to(pixels, device)
        elif isinstance(pixels, list):
            pixels = torch.cat(pixels)
        return MicroBatch(
            indices=self.indices,
            lengths=self.lengths,
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            pixel_values=move(pixels),
            image_grid_thw=self.image_grid_thw
            if self.vision_inputs is not None
            else move(self.image_grid_thw),
            fields={k: move(v) for k, v in self.fields.items()},
            has_dummy=self.has_dummy,
            loss_units=self.loss_units,
            loss_positions=move(self.loss_positions),
            vision_inputs=None
            if self.vision_inputs is None
            else {
                k: move(v) if isinstance(v, Tensor) else v for k, v in self.vision_inputs.items()
            },
        )


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Copy a host tensor to ``device`` without blocking the host.

    A pageable source makes the CUDA copy synchronous (the driver stages it through its own
    pinned buffer while the host waits); from pinned memory the copy is queued and the host
    goes on launching kernels. torch's caching host allocator keeps the pinned block alive
    until the copy has run.
    """
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, non_blocking=True)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class PinnedStaging:
    """Reused pinned host buffers for the micro-batches' pixels, taken in turn.

    A fresh pinned tensor per micro-batch goes through torch's caching host allocator, which
    page-locks a new block (``cudaHostAlloc``, tens of milliseconds for the 2B benchmark's
    50 MB of pixels) whenever none of its size is free yet: the H200 benchmark's steps stalled
    15-49 ms in that allocation, on and off for the first steps of a run, and images of varying
    sizes keep asking for new sizes. These buffers grow to the largest micro-batch and stay.
    A buffer is written again only after the copy out of it has run on the device (an event
    recorded behind the copy); with ``slots`` buffers in turn that copy is ``slots - 1``
    micro-batches old, so the host practically never waits. ``pin=False`` (tests on the CPU)
    keeps the same logic over plain memory.
    """

    def __init__(self, slots: int = 2, *, pin: bool = True) -> None:
        self.pin = pin
        self._buffers: list[Tensor | None] = [None] * slots
        self._copied: list[Any] = [None] * slots  # torch.cuda.Event behind each buffer's copy
        self._next = 0

    def stage(self, parts: list[Tensor]) -> tuple[Tensor, int]:
        """``torch.cat(parts)`` written into the next buffer; returns it and its slot."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # the copy out of it has run
            self._copied[slot] = None
        rows = sum(p.shape[0] for p in parts)
        shape, dtype = (rows, *parts[0].shape[1:]), parts[0].dtype
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[slot] = buffer
        out = buffer[:nbytes].view(dtype).view(shape)
        return torch.cat(parts, out=out), slot

    def copy_to(self, parts: list[Tensor], device: torch.device) -> Tensor:
        """``torch.cat(parts)`` on ``device``: staged in a buffer, then copied without
        blocking (always a copy: the buffer is written again later)."""
        staged, slot = self.stage(parts)
        moved = staged.to(device, non_blocking=True, copy=True)
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copied[slot] = event
        return moved

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(b.numel() for b in self._buffers if b is not None)


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Pack sample indices to ``max_tokens`` per micro-batch, with the same count on all ranks.

    A rank that needs fewer micro-batches than the busiest rank first splits its largest
    multi-sample micro-batches (smaller forwards, no wasted work), then adds empty ones (run as a
    dummy sample only).
    """
    bins = pack_by_token_budget(lengths, max_tokens) if lengths else []
    target = int(all_reduce_(torch.tensor([len(bins)]), torch.distributed.ReduceOp.MAX).item())
    while len(bins) < target:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        big = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(big)
        half, acc, total = [], 0, sum(lengths[i] for i in big)
        for i in big:
            if acc < total / 2 and len(half) < len(big) - 1:
                half.append(i)
                acc += lengths[i]
        rest = [i for i in big if i not in half]
        bins.extend([half, rest])
    return bins


def dummy_image(config: PretrainedConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Smallest image the vision tower takes: one merged token. ``(input_ids, pixels, grid)``."""
    vc = config.vision_config
    merge = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    grid = torch.tensor([[1, merge, merge]])
    pixels = torch.zeros(merge * merge, patch_dim)
    ids = torch.tensor([config.image_token_id])
    return ids, pixels, grid


def _check_image_tokens(
    ids: list[Tensor], grids: list[Tensor | None], config: PretrainedConfig, names: list
) -> None:
    """Each sample's image placeholders match its images' merged patches. Checked here, on the
    host, because the model's own device-side check is removed (vlm_models.sync_free)."""
    image_id = config.image_token_id
    merge = config.vision_config.spatial_merge_size
    for name, t, grid in zip(names, ids, grids, strict=False):
        tokens = int((t == image_id).sum())
        expected = 0 if grid is None else int(grid.long().prod(-1).sum()) // merge**2
        if tokens != expected:
            raise ValueError(
                f"sample {name}: {tokens} image placeholder tokens but its images give "
                f"{expected} merged patches (image_grid_thw {None if grid is None else grid.tolist()})"
            )


def build_micro_batch(
    batch: TrainBatch,
    indices: list[int],
    config: PretrainedConfig,
    *,
    need_vision: bool,
) -> MicroBatch:
    """Pack ``batch`` samples ``indices`` into one row (CPU tensors).

    ``need_vision``: append a dummy image sample when no real sample has an image, so that the
    vision tower runs (FSDP collectives must match across ranks). With no ``indices`` the row is
    the dummy alone.
    """
    ids = [batch.input_ids[i].reshape(-1).long() for i in indices]
    grids = [batch.image_grid_thw[i] if batch.image_grid_thw else None for i in indices]
    pixels = [batch.pixel_values[i] if batch.pixel_values else None for i in indices]
    types = [batch.mm_token_type_ids[i] for i in indices] if batch.mm_token_type_ids else None
    has_image = any(g is not None and len(g) for g in grids)
    add_dummy = not indices or (need_vision and not has_image)
    if add_dummy:
        d_ids, d_pix, d_grid = dummy_image(config)
        ids, grids, pixels = [*ids, d_ids], [*grids, d_grid], [*pixels, d_pix]
        if types is not None:
            types = [*types, torch.ones_like(d_ids, dtype=torch.int32)]
    lengths = [int(t.numel()) for t in ids]
    _check_image_tokens(ids, grids, config, [*indices, "dummy"])
    mrope = packed_position_ids(ids, grids, config, types)
    text = torch.cat([torch.arange(n) for n in lengths])
    present = [(p, g) for p, g in zip(pixels, grids, strict=True) if g is not None and len(g)]
    if any(p is None for p, _ in present):
        raise ValueError("a sample has image_grid_thw but no pixel_values")
    fields = {}
    for name in _PER_TOKEN:
        values = getattr(batch, name)
        if values is not None and indices:
            fields[name] = torch.cat([values[i].reshape(-1).float() for i in indices])
    masks = [batch.loss_mask[i] > 0 for i in indices]
    loss_units = {mode: loss_denominator(masks, mode) for mode in get_args(LossAggMode)}
    positions, start = [], 0
    for m in masks:
        local = m.nonzero().reshape(-1)
        positions.append(local[local > 0] + start)
        start += int(m.numel())
    return MicroBatch(
        indices=list(indices),
        lengths=lengths,
        input_ids=torch.cat(ids),
        position_ids=torch.cat([text[None], mrope.long()], dim=0),
        pixel_values=[p for p, _ in present] if present else None,
        image_grid_thw=torch.cat([g for _, g in present]).long() if present else None,
        fields=fields,
        has_dummy=add_dummy,
        loss_units=loss_units,
        loss_positions=torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long),
    )
