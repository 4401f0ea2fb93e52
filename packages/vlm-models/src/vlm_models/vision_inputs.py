"""The vision tower's per-patch inputs computed on the host, handed to its forward by a hook.

transformers derives the Qwen3-VL tower's per-patch inputs from ``grid_thw`` on the device
inside the forward: position-embedding interpolation taps, rotary position ids and attention
boundaries, with ``tolist()`` / ``repeat_interleave`` host syncs and a Python loop of small
kernels per image. Since transformers 5.17 the vision forward takes these precomputed, as
keywords (``transformers.vision_utils``). :class:`VisionInputs` computes them on the host when a
micro-batch is built (the same functions, on CPU tensors, so the values are identical) and
hands them to the tower through a forward pre-hook, so they never reach the language model's
keywords. Both trainers use it: the FSDP actor on the transformers model, the Megatron model on
the transformers tower it wraps.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

# The keywords transformers' vision forward pops from its kwargs, and the helper computing each.
_HELPERS = (
    "get_vision_interpolation_indices_and_weights",
    "get_vision_position_ids",
    "get_vision_attention_seqlens",
)
_ATTRIBUTES = ("num_grid_per_side", "interpolation_mode", "interpolation_align_corners")


class VisionInputs:
    """Precomputed vision-tower inputs for the micro-batch being run, injected by a pre-hook.

    Example::

        inputs = VisionInputs.attach(model)        # None when the tower takes no precomputed keys
        kwargs = inputs.compute(image_grid_thw)    # on the host, when the micro-batch is built
        with inputs.use(moved_kwargs):             # moved to the device with the micro-batch
            model(**batch)
    """

    def __init__(self, visual: nn.Module) -> None:
        self.visual = visual
        self._current: dict[str, Any] | None = None
        visual.register_forward_pre_hook(self._inject, with_kwargs=True)

    @classmethod
    def attach(cls, model: nn.Module) -> VisionInputs | None:
        """Hook ``model``'s vision tower if its forward takes the precomputed keywords."""
        return cls.attach_tower(getattr(getattr(model, "model", None), "visual", None))

    @classmethod
    def attach_tower(cls, visual: nn.Module | None) -> VisionInputs | None:
        """Hook the vision tower ``visual`` itself (None when it takes no precomputed keys)."""
        if visual is None or not all(hasattr(visual, a) for a in _ATTRIBUTES):
            return None
        try:
            import transformers.vision_utils  # noqa: F401

            source = inspect.getsource(type(visual).forward)
        except (ImportError, OSError, TypeError):
            return None
        if not all(name in source for name in _HELPERS):
            logger.info("%s computes its inputs itself: left as it is", type(visual).__name__)
            return None
        return cls(visual)

    def compute(self, grid_thw: Tensor) -> dict[str, Any]:
        """The tower's inputs for images ``grid_thw`` (``[n, 3]``, CPU), as its forward would
        compute them, plus ``max_seqlen`` as a Python int.

        Every per-patch input depends only on its own image's grid, so each distinct grid is
        computed once and the images' parts are concatenated: in GRPO the samples of a group
        repeat one image, and a micro-batch holds whole groups."""
        from transformers import vision_utils

        grid = grid_thw.long().cpu()
        parts: dict[tuple[int, ...], tuple[Tensor, Tensor, Tensor]] = {}
        rows = [tuple(row) for row in grid.tolist()]
        for i, row in enumerate(rows):
            if row not in parts:
                parts[row] = self._per_patch(grid[i : i + 1])
        indices, weights, position_ids = (
            torch.cat([parts[row][k] for row in rows]) for k in range(3)
        )
        cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
        return {
            "interp_indices": indices,
            "interp_weights": weights,
            "position_ids": position_ids,
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        }

    def _per_patch(self, grid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Interpolation taps, their weights and rotary position ids of the images ``grid``."""
        from transformers import vision_utils

        visual = self.visual
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=visual.config.spatial_merge_size,
        )
        position_ids = vision_utils.get_vision_position_ids(grid, visual.spatial_merge_size)
        return indices, weights, position_ids

    @contextmanager
    def use(self, inputs: dict[str, Any] | None) -> Iterator[None]:
        """Inject ``inputs`` (already on the compute device) into the tower's forwards inside."""
        self._current = inputs
        try:
            yield
        finally:
            self._current = None

    def _inject(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._current is None:
            return None
        return args, {**kwargs, **self._current}
