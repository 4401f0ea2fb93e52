"""Patch embedding as one matrix product instead of a Conv3d.

Qwen3-VL (and Qwen3.5) embed each flattened ``3 x 2 x 16 x 16`` patch with a ``Conv3d`` whose
kernel equals its stride. That is a plain linear map of the flattened patch, but cuDNN 9.x runs
the 5-D convolution far slower than the equivalent GEMM. :class:`LinearPatchEmbed` computes
``F.linear(x, weight.view(out, -1), bias)`` on the *same* ``Conv3d`` parameter, so state dict
keys and shapes (``...patch_embed.proj.weight`` of shape ``[out, C, T, P, P]``) are unchanged:
checkpoints load and save in the original layout, and FSDP / weight sync see the HF names.

:class:`GemmPatchEmbed` is that forward for the model files' patch embedding classes (a module
of transformers' class runs it after ``build_model``); the two standalone modules below are
the same two forms over a shared ``Conv3d``, for tests and benchmarks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_models.classes import Ours


def _gemm_embed(proj: nn.Conv3d, hidden_states: torch.Tensor) -> torch.Tensor:
    """The Conv3d with kernel == stride as one GEMM over its own weight."""
    weight = proj.weight
    x = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    # weight.view keeps (C, T, P, P) order, the same flattening the processor uses per patch.
    return F.linear(x, weight.view(weight.shape[0], -1), proj.bias)


class GemmPatchEmbed(Ours, nn.Module):
    """Mixin before transformers' ``*VisionPatchEmbed`` (a ``proj`` Conv3d): GEMM forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _gemm_embed(self.proj, hidden_states)

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        """A Conv3d ``proj`` whose kernel equals its stride, without padding."""
        proj = getattr(module, "proj", None)
        return (
            isinstance(proj, nn.Conv3d)
            and tuple(proj.kernel_size) == tuple(proj.stride)
            and all(p == 0 for p in proj.padding)
        )


class LinearPatchEmbed(nn.Module):
    """Drop-in for ``Qwen3VLVisionPatchEmbed``: same ``proj`` Conv3d parameters, GEMM forward."""

    def __init__(self, proj: nn.Conv3d) -> None:
        super().__init__()
        if tuple(proj.kernel_size) != tuple(proj.stride) or any(p != 0 for p in proj.padding):
            raise ValueError(f"patch conv must have kernel == stride and no padding, got {proj}")
        self.proj = proj  # kept as the parameter holder so state_dict keys stay "proj.weight"
        self.in_channels = proj.in_channels
        self.embed_dim = proj.out_channels
        self.temporal_patch_size, self.patch_size, _ = proj.kernel_size

    @property
    def patch_dim(self) -> int:
        return self.proj.weight[0].numel()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _gemm_embed(self.proj, hidden_states)

    def extra_repr(self) -> str:
        return f"patch_dim={self.patch_dim}, embed_dim={self.embed_dim} (GEMM over Conv3d weight)"


class Conv3dPatchEmbed(nn.Module):
    """The original Conv3d formulation over a shared ``proj`` (the baseline in benchmarks)."""

    def __init__(self, proj: nn.Conv3d) -> None:
        super().__init__()
        self.proj = proj
        self.in_channels = proj.in_channels
        self.embed_dim = proj.out_channels
        self.temporal_patch_size, self.patch_size, _ = proj.kernel_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.view(
            -1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size
        )
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, self.embed_dim)
