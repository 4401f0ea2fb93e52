"""Micro-batches: samples packed end to end into one row of ``T`` tokens, without padding.

One :class:`MicroBatch` type serves every trainer backend. Each sample keeps its own M-RoPE
positions (:func:`vlm_models.packed_position_ids`) and its attention stays inside its own
span (``cu_seqlens``). Filler samples, when a backend needs them, come after the real ones:
a one-image dummy (FSDP runs the vision tower on every rank in every forward, its blocks
all-gather their parameters) and a padding sample (Megatron's sequence parallelism splits the
row evenly over the tensor-parallel ranks). Fillers are never in the loss.

The batch is read by attribute (``rl_algos.TrainBatch`` or anything with its per-sample lists),
so this package does not depend on rl-algos.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from vlm_models.packing import cu_seqlens_from_lengths, packed_position_ids

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """One packed row. Real samples come first; filler samples (dummy image, padding) last."""

    indices: list[int]  # sample indices into the batch (real samples only)
    lengths: list[int]  # token count of each packed sample, fillers included
    input_ids: Tensor  # LongTensor[T]
    position_ids: Tensor  # LongTensor[4, T]: text positions, then M-RoPE (t, h, w)
    # FloatTensor[P, D], all images of the row; per-sample parts until moved (then
    # concatenated straight into the pinned staging buffer, not into a host tensor of its own)
    pixel_values: Tensor | list[Tensor] | None
    image_grid_thw: Tensor | None  # LongTensor[n_img, 3]
    fields: dict[str, Tensor]  # per-token training fields over the real tokens, [T_real]
    loss_tokens: list[int]  # loss-mask tokens of each real sample (host ints)
    loss_positions: Tensor  # LongTensor[R]: loss tokens that have a predecessor in their sample
    image_positions: Tensor | None = None  # LongTensor[n]: flat indices of image placeholders
    has_dummy: bool = False  # a one-image dummy sample follows the real ones
    # the vision tower's precomputed inputs (vlm_models.VisionInputs.compute), or None
    vision_inputs: dict[str, Any] | None = None
    # int32 [n + 1]: sample boundaries (packed attention), set when moved to the device by .to
    cu_seqlens: Tensor | None = None
    # a backend's split of the row over context-parallel ranks (the Megatron actor's), already
    # on the device; carried unchanged by .to
    context_parallel: Any = None
    # IntTensor[T, num_hidden_layers, top_k]: the engine's expert ids of every token of the
    # row, fillers included (routing replay); None when the batch has none
    routed_experts: Tensor | None = None

    @property
    def num_real_tokens(self) -> int:
        return sum(self.lengths[: len(self.indices)])

    @property
    def real_cu_seqlens(self) -> list[int]:
        """Boundaries of the real samples, from the host lengths."""
        cu = [0]
        for n in self.lengths[: len(self.indices)]:
            cu.append(cu[-1] + n)
        return cu

    @property
    def max_seqlen(self) -> int:
        """The longest packed sample, fillers included (known on the host)."""
        return max(self.lengths)

    def to(self, device: torch.device, staging: PinnedStaging | None = None) -> MicroBatch:
        """The same micro-batch on ``device``, with :attr:`cu_seqlens` added.

        Every host tensor goes through ``staging`` (on CUDA a one-off :class:`PinnedStaging`
        when None) in one asynchronous copy from pinned memory, so the host goes on launching
        kernels. With precomputed vision inputs ``image_grid_thw`` stays on the host: the model
        then reads it only as a list (its split sizes), which from a device tensor is a sync."""
        host_grid = self.vision_inputs is not None
        named: dict[str, Any] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "loss_positions": self.loss_positions,
            "cu_seqlens": cu_seqlens_from_lengths(self.lengths),
            **{f"fields.{k}": v for k, v in self.fields.items()},
        }
        if self.pixel_values is not None:
            named["pixel_values"] = self.pixel_values
        if self.image_grid_thw is not None and not host_grid:
            named["image_grid_thw"] = self.image_grid_thw
        if self.image_positions is not None:
            named["image_positions"] = self.image_positions
        if self.routed_experts is not None:
            named["routed_experts"] = self.routed_experts
        for k, v in (self.vision_inputs or {}).items():
            if isinstance(v, Tensor):
                named[f"vision_inputs.{k}"] = v
        if staging is not None or device.type == "cuda":
            moved = (staging or PinnedStaging(slots=1)).copy_to(list(named.values()), device)
            out = dict(zip(named, moved, strict=True))
        else:
            out = {
                k: (torch.cat(v) if isinstance(v, list) else v).to(device) for k, v in named.items()
            }
        return MicroBatch(
            indices=self.indices,
            lengths=self.lengths,
            input_ids=out["input_ids"],
            position_ids=out["position_ids"],
            pixel_values=out.get("pixel_values"),
            image_grid_thw=self.image_grid_thw if host_grid else out.get("image_grid_thw"),
            fields={k: out[f"fields.{k}"] for k in self.fields},
            loss_tokens=self.loss_tokens,
            loss_positions=out["loss_positions"],
            image_positions=out.get("image_positions"),
            has_dummy=self.has_dummy,
            vision_inputs=None
            if self.vision_inputs is None
            else {k: out.get(f"vision_inputs.{k}", v) for k, v in self.vision_inputs.items()},
            cu_seqlens=out["cu_seqlens"],
            context_parallel=self.context_parallel,
            routed_experts=out.get("routed_experts"),
        )


class PinnedStaging:
    """Reused pinned host buffers through which each micro-batch reaches the device in one copy.

    Every host tensor of a micro-batch (the pixels, the ids and positions, the per-token fields,
    the vision inputs, the sample boundaries) is written into one pinned buffer at an aligned
    offset and moved with one asynchronous copy; on the device each tensor is a view of that
    copy. Pinning each tensor on its own costs a dozen trips through torch's caching host
    allocator per micro-batch, and one that finds no free block of the size page-locks new
    memory (``cudaHostAlloc``: 15-49 ms for the 2B benchmark's 50 MB of pixels, measured on the
    H200 machine). These buffers grow to the largest micro-batch and stay. A buffer is written
    again only after the copy out of it has run on the device (an event recorded behind the
    copy); with ``slots`` buffers in turn that copy is ``slots - 1`` micro-batches old, so the
    host practically never waits. ``pin=False`` (tests on the CPU) keeps the same logic over
    plain memory.
    """

    ALIGN = 64  # bytes: every staged tensor starts at a multiple of this

    def __init__(self, slots: int = 2, *, pin: bool = True) -> None:
        self.pin = pin
        self._buffers: list[Tensor | None] = [None] * slots
        self._copied: list[Any] = [None] * slots  # torch.cuda.Event behind each buffer's copy
        self._next = 0

    def copy_to(
        self, items: Sequence[Tensor | Sequence[Tensor]], device: torch.device
    ) -> list[Tensor]:
        """Each item on ``device``, in one copy: a tensor as it is, a list of tensors
        concatenated along the first dimension. Always copies (the buffer is written again
        later)."""
        layout: list[tuple[list[Tensor], int, torch.dtype, tuple[int, ...]]] = []
        size = 0
        for item in items:
            parts = [item] if isinstance(item, Tensor) else list(item)
            first = parts[0]
            shape = (
                tuple(first.shape)
                if len(parts) == 1
                else (sum(p.shape[0] for p in parts), *first.shape[1:])
            )
            layout.append((parts, size, first.dtype, shape))
            size += -(-math.prod(shape) * first.dtype.itemsize // self.ALIGN) * self.ALIGN
        staged, slot = self._take(size)
        for parts, offset, dtype, shape in layout:
            view = _typed(staged, offset, dtype, shape)
            if len(parts) == 1:
                view.copy_(parts[0])
            else:
                torch.cat(parts, out=view)
        moved = staged[:size].to(device, non_blocking=True, copy=True)
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copied[slot] = event
        return [_typed(moved, offset, dtype, shape) for _, offset, dtype, shape in layout]

    def _take(self, nbytes: int) -> tuple[Tensor, int]:
        """The next buffer, at least ``nbytes`` long, once the copy out of it has run."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
            self._copied[slot] = None
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[slot] = buffer
        return buffer, slot

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(b.numel() for b in self._buffers if b is not None)


def _typed(buffer: Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """The bytes of ``buffer`` from ``offset`` viewed as a ``dtype`` tensor of ``shape``."""
    n = math.prod(shape) * dtype.itemsize
    return buffer[offset : offset + n].view(dtype).view(shape)


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
    host, because the model's own device-side check is removed (``build_model(sync_free=True)``)."""
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


def _pack_routed_experts(
    values: Sequence[Tensor], names: list, config: PretrainedConfig, lengths: list[int]
) -> Tensor:
    """The real samples' expert ids then the fillers' (the first ``k`` experts: valid ids that
    no loss reads), int32 ``[T, layers, k]``. Shapes and id ranges are checked here, on the
    host: an id out of range would be a device-side assert in the router's gather."""
    text = getattr(config, "text_config", config)
    layers, top_k = text.num_hidden_layers, getattr(text, "num_experts_per_tok", None)
    num_experts = getattr(text, "num_experts", None)
    if not num_experts or not top_k:
        raise ValueError(f"routed_experts given for {config.model_type}, which has no experts")
    parts = []
    for name, ids, length in zip(names, values, lengths, strict=False):
        if tuple(ids.shape) != (length, layers, top_k):
            raise ValueError(
                f"sample {name}: routed_experts has shape {tuple(ids.shape)}, expected "
                f"({length}, {layers}, {top_k}) (tokens, decoder layers, experts per token)"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise ValueError(
                f"sample {name}: routed_experts holds ids in [{int(ids.min())}, "
                f"{int(ids.max())}], the model has {num_experts} experts"
            )
        parts.append(ids.to(torch.int32))
    fillers = sum(lengths[len(values) :])
    if fillers:
        first = torch.arange(top_k, dtype=torch.int32)
        parts.append(first.expand(fillers, layers, top_k))
    return torch.cat(parts)


def replays_routes(batch: Any, routing_replay: bool) -> bool:
    """Whether ``batch``'s micro-batches carry expert ids to replay: ``routing_replay`` is on
    and the batch has ``routed_experts``. On without them, the trainer routes by itself, which
    is logged once (every step would say it again)."""
    if not routing_replay:
        return False
    if getattr(batch, "routed_experts", None) is None:
        if len(batch.input_ids):
            _log_unrouted()
        return False
    return True


@functools.cache
def _log_unrouted() -> None:
    logger.warning(
        "routing_replay is on but a batch has no routed_experts: the trainer routes it by "
        "itself (logged once)"
    )


def build_micro_batch(
    batch: Any,
    indices: Sequence[int],
    config: PretrainedConfig,
    *,
    fields: Sequence[str] = (),
    need_vision: bool = False,
    pad_to_multiple: int = 1,
    routed_experts: bool = True,
) -> MicroBatch:
    """Pack ``batch`` samples ``indices`` into one row (CPU tensors).

    ``fields``: the per-token batch fields to pack (those a loss reads; ``loss_mask`` always
    gives :attr:`MicroBatch.loss_tokens` and ``loss_positions``). ``need_vision``: append a
    dummy image sample when no real sample has an image, so that the vision tower runs (FSDP
    collectives must match across ranks); with no ``indices`` the row is the dummy alone.
    ``pad_to_multiple``: append a padding sample (token 0) so the row's length divides by it.
    ``routed_experts``: pack the batch's ``routed_experts`` (when it has them) over the row.
    """
    indices = list(indices)
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
    mrope = packed_position_ids(ids, grids, config, types).long()
    text = torch.cat([torch.arange(n) for n in lengths])
    positions = torch.cat([text[None], mrope], dim=0)
    flat = torch.cat(ids)
    pad = -len(flat) % pad_to_multiple
    if pad:  # one padding sample with plain positions
        flat = torch.cat([flat, flat.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad).expand(4, -1)], dim=1)
        lengths.append(pad)
    present = [(p, g) for p, g in zip(pixels, grids, strict=True) if g is not None and len(g)]
    if any(p is None for p, _ in present):
        raise ValueError("a sample has image_grid_thw but no pixel_values")
    packed = {}
    for name in fields:
        values = getattr(batch, name)
        if values is not None and indices:
            packed[name] = torch.cat([values[i].reshape(-1).float() for i in indices])
    masks = [batch.loss_mask[i].reshape(-1) > 0 for i in indices]
    loss_positions, start = [], 0
    for m in masks:
        local = m.nonzero().reshape(-1)
        loss_positions.append(local[local > 0] + start)
        start += int(m.numel())
    image_positions = None
    if present:
        image_positions = (flat == config.image_token_id).nonzero().reshape(-1)
    routes = None
    if routed_experts and getattr(batch, "routed_experts", None) is not None:
        chosen = [batch.routed_experts[i] for i in indices]
        routes = _pack_routed_experts(chosen, indices, config, lengths)
    return MicroBatch(
        indices=indices,
        lengths=lengths,
        input_ids=flat,
        position_ids=positions,
        pixel_values=[p for p, _ in present] if present else None,
        image_grid_thw=torch.cat([g for _, g in present]).long() if present else None,
        fields=packed,
        loss_tokens=[int(m.sum()) for m in masks],
        loss_positions=(
            torch.cat(loss_positions) if loss_positions else torch.zeros(0, dtype=torch.long)
        ),
        image_positions=image_positions,
        has_dummy=add_dummy,
        routed_experts=routes,
    )
