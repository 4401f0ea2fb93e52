"""Patch embedding as one matrix product instead of a Conv3d.

Qwen3-VL (and Qwen3.5) embed each flattened ``3 x 2 x 16 x 16`` patch with a ``Conv3d`` whose
kernel equals its stride. That is a plain linear map of the flattened patch, but cuDNN 9.x runs
the 5-D convolution far slower than the equivalent GEMM. :class:`LinearPatchEmbed` computes
``F.linear(x, weight.view(out, -1), bias)`` on the *same* ``Conv3d`` parameter, so state dict
keys and shapes (``...patch_embed.proj.weight`` of shape ``[out, C, T, P, P]``) are unchanged:
checkpoints load and save in the original layout, and FSDP / weight sync see the HF names.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


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
        weight = self.proj.weight
        x = hidden_states.reshape(-1, self.patch_dim).to(weight.dtype)
        # weight.view keeps (C, T, P, P) order, the same flattening the processor uses per patch.
        return F.linear(x, weight.view(self.embed_dim, -1), self.proj.bias)

    def extra_repr(self) -> str:
        return f"patch_dim={self.patch_dim}, embed_dim={self.embed_dim} (GEMM over Conv3d weight)"


class Conv3dPatchEmbed(nn.Module):
    """The original Conv3d formulation over a shared ``proj`` (used to switch back, and as the
    baseline in benchmarks)."""

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


def _patch_embed_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, module) for every patch embedding holding a kernel==stride Conv3d."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            proj = getattr(child, "proj", None)
            if (
                name == "patch_embed"
                and isinstance(proj, nn.Conv3d)
                and tuple(proj.kernel_size) == tuple(proj.stride)
            ):
                found.append((parent, name, child))
    return found


def set_fast_patch_embed(model: nn.Module, enabled: bool = True) -> int:
    """Switch every vision patch embedding of ``model`` to the GEMM form (or back to Conv3d).

    Parameters are shared, not copied, so this is cheap and may be called on a model that is
    already on its device. Returns how many modules were switched.
    """
    target = LinearPatchEmbed if enabled else Conv3dPatchEmbed
    modules = _patch_embed_modules(model)
    for parent, name, module in modules:
        if not isinstance(module, target):
            setattr(parent, name, target(module.proj))
    if not modules:
        logger.warning("no Conv3d patch embedding found in %s", type(model).__name__)
    return len(modules)
