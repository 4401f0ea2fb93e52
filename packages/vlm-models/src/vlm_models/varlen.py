"""FlashAttention over packed samples (varlen), shared by the FSDP and Megatron paths.

Both trainers pack several samples into one row and need attention confined to each sample.
torch ships FlashAttention's varlen kernel as an aten op (``torch.nn.attention.varlen`` wraps
it), so no flash-attn install is needed on CUDA.
"""

from __future__ import annotations

import torch

HAS_FLASH_VARLEN: bool = hasattr(torch.ops.aten, "_flash_attention_forward")


def flash_varlen_supported(q: torch.Tensor) -> bool:
    """Whether :func:`flash_varlen` can run on ``q`` (CUDA, half precision, op present)."""
    return HAS_FLASH_VARLEN and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """FlashAttention over the samples ``cu_seqlens`` (int32) of ``q``, ``k``, ``v``
    (``[T, H, D]``; ``k`` and ``v`` may have fewer heads, GQA), as ``[T, H, D]``.

    The aten op itself rather than ``torch.nn.attention.varlen.varlen_attn``, which wraps it in
    a Python custom op: that adds host work and a kernel per call in every layer, and its
    list-typed argument keeps inductor's C++ wrapper from compiling the layer. ``max_seqlen``
    is a Python int so that no call reads the device.
    """
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale
    )
    return out[0]
