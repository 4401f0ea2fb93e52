"""A model's weights under their HF (checkpoint) names and layout; the buckets for weight sync
are made from these by ``weight_sync.iter_weight_buckets``."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters and persistent buffers under their HF names, tied weights once (as in a
    checkpoint: a tied ``lm_head.weight`` is left out)."""
    yield from model.named_parameters()
    seen = set()
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield (f"{module_name}.{name}" if module_name else name), buf


def to_checkpoint_layout(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Undo transformers' load-time conversions (e.g. Qwen3-VL-MoE stores experts transposed in
    memory) so names and shapes are those of the checkpoint files, as ``save_pretrained`` writes."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: in-memory layout is the checkpoint layout
        return tensors
    return revert_weight_conversion(model, tensors)


@torch.no_grad()
def load_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
    """Copy ``(name, tensor)`` pairs (in-memory HF names) into ``model``; returns how many."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    count = 0
    for name, tensor in named_tensors:
        if name not in params:
            raise KeyError(f"{name} is not a parameter or buffer of {type(model).__name__}")
        params[name].copy_(tensor)
        count += 1
    return count
