"""How checkpoint files store MoE experts that transformers holds stacked in memory
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``):
released Qwen3-VL-MoE files hold them transposed (``[E, H, 2I]``, ``[E, I, H]``), Qwen3.5-MoE
files one tensor per expert (``experts.{e}.gate_proj`` ...). The checkpoint reader turns files
into the in-memory layout (:func:`from_file_layout`, :func:`stack_experts`), the export and
weight sync turn it back (:func:`to_file_layout`, :func:`to_checkpoint_tensors`). Apart from
the Megatron conversion (:mod:`vlm_models.megatron.convert`), which works on the in-memory
layout only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlm_models.megatron.config import TextArch

#: The suffixes of the stacked expert tensors' HF names.
EXPERT_STACKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _memory_shape(name: str, arch: TextArch) -> tuple[int, int, int]:
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
    return (e, 2 * i, h) if name.endswith("gate_up_proj") else (e, h, i)


def is_released_expert_layout(name: str, shape: tuple[int, ...], arch: TextArch) -> bool:
    """Whether a file's stacked-expert tensor is in the released (transposed) layout.

    Released Qwen3-VL-MoE files hold ``[E, H, 2I]`` / ``[E, I, H]``; transformers keeps
    ``[E, 2I, H]`` / ``[E, H, I]`` in memory and 5.x ``save_pretrained`` writes that. Like
    transformers, a shape equal to the in-memory one counts as in-memory (square experts are
    ambiguous).
    """
    return name.endswith(EXPERT_STACKS) and tuple(shape) != _memory_shape(name, arch)


def from_file_layout(name: str, tensor: Tensor, arch: TextArch) -> Tensor:
    """A checkpoint-file tensor in transformers' in-memory layout."""
    if is_released_expert_layout(name, tuple(tensor.shape), arch):
        return tensor.transpose(1, 2).contiguous()
    return tensor


def to_file_layout(name: str, tensor: Tensor, *, released: bool = True) -> Tensor:
    """An in-memory tensor in the released files' layout (``released=False``: unchanged)."""
    if released and name.endswith(EXPERT_STACKS):
        return tensor.transpose(1, 2).contiguous()
    return tensor


def to_checkpoint_tensors(name: str, tensor: Tensor, arch: TextArch) -> list[tuple[str, Tensor]]:
    """An in-memory tensor as ``save_pretrained`` writes it and SGLang reads it (the wire layout
    of weight sync): Qwen3.5-MoE experts one per tensor, Qwen3-VL-MoE's transposed."""
    if not name.endswith(EXPERT_STACKS):
        return [(name, tensor)]
    if arch.per_expert_files:
        return split_experts(name, tensor)
    return [(name, to_file_layout(name, tensor))]


def per_expert_names(name: str, num_experts: int) -> list[tuple[str, ...]]:
    """The per-expert file names of stacked tensor ``name`` (Qwen3.5-MoE files, which
    transformers stacks on load: ``experts.{e}.gate_proj`` / ``up_proj`` -> ``gate_up_proj``,
    ``experts.{e}.down_proj`` -> ``down_proj``)."""
    base = name.rsplit(".", 1)[0]  # "...mlp.experts"
    if name.endswith("gate_up_proj"):
        return [
            (f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight")
            for e in range(num_experts)
        ]
    return [(f"{base}.{e}.down_proj.weight",) for e in range(num_experts)]


def stack_experts(parts: list[list[Tensor]]) -> Tensor:
    """The stacked in-memory tensor from each expert's file tensors (gate and up, or down)."""
    return torch.stack([torch.cat(p) if len(p) > 1 else p[0] for p in parts])


def split_experts(name: str, stacked: Tensor) -> list[tuple[str, Tensor]]:
    """Inverse of :func:`stack_experts`, under :func:`per_expert_names`."""
    out = []
    for names, expert in zip(per_expert_names(name, stacked.shape[0]), stacked, strict=True):
        out += zip(names, expert.chunk(len(names)), strict=True)
    return [(n, t.contiguous()) for n, t in out]
