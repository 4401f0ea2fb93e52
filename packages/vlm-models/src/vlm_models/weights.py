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


#: transformers' stacked MoE experts (in memory ``[E, 2I, H]`` and ``[E, H, I]``)
EXPERT_STACKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def released_expert_transpose(model: nn.Module) -> bool:
    """Whether the wire holds this model's stacked experts transposed (Qwen3-VL-MoE: released
    files are ``[E, H, 2I]`` / ``[E, I, H]``, which SGLang's ``qwen3_vl_moe.py`` loader
    transposes back unconditionally)."""
    return getattr(getattr(model, "config", None), "model_type", None) == "qwen3_vl_moe"


def to_checkpoint_layout(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Undo transformers' load-time conversions (Qwen3.5-MoE: stacked experts back to one
    tensor per expert) so names and shapes are what ``save_pretrained`` writes."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: in-memory layout is the checkpoint layout
        return tensors
    return revert_weight_conversion(model, tensors)


def to_wire_layout(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """In-memory tensors in the one wire layout of weight sync: the checkpoint files' names and
    shapes as SGLang's loaders read them from disk. That is :func:`to_checkpoint_layout`, except
    Qwen3-VL-MoE's stacked experts, transposed here as in the released files: transformers 5.19
    writes them in memory's layout (its reverted ``Transpose(check_dims=True)`` compares against
    the parameter of the same name), while SGLang's loader transposes them unconditionally."""
    stacks: dict[str, Tensor] = {}
    if released_expert_transpose(model):
        stacks = {
            n: t.transpose(1, 2).contiguous()
            for n, t in tensors.items()
            if n.endswith(EXPERT_STACKS)
        }
        tensors = {n: t for n, t in tensors.items() if n not in stacks}
    return {**to_checkpoint_layout(model, tensors), **stacks}


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
