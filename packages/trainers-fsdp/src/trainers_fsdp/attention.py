"""Attention within sample boundaries for packed micro-batches, as a transformers attention backend.

A packed micro-batch is one row of concatenated samples. transformers' ``sdpa`` backend handles
that by building a dense block-causal ``[T, T]`` mask, which rules out the flash kernel and
spends the full ``T^2`` attention cost. This backend takes the sample boundaries
(:class:`PackedSeqInfo`, passed as the ``packed_seq_info`` forward keyword) and runs

- on CUDA with bf16/fp16, FlashAttention's varlen kernel (:func:`flash_varlen`, the aten op
  that ``torch.nn.attention.varlen`` wraps);
- otherwise one causal ``scaled_dot_product_attention`` per sample (flash / efficient kernels on
  GPU, the math kernel on CPU).

Non-causal modules (the vision blocks, which already split by image) and calls without
``packed_seq_info`` fall back to transformers' ``sdpa``. Register once with
:func:`register_packed_attention`, then build the model with ``attn_implementation="packed"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlm_models.varlen import HAS_FLASH_VARLEN, flash_varlen

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "packed"


@dataclass(frozen=True)
class PackedSeqInfo:
    """Sample boundaries of a packed row: ``cu_seqlens`` (int32, on the compute device), the
    lengths as Python ints (no host sync per layer) and the longest length."""

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    max_seqlen: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> PackedSeqInfo:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        if device.type == "cuda":  # queued copy from pinned memory, no host wait
            cu = cu.pin_memory().to(device, non_blocking=True)
        return cls(cu.to(device), tuple(int(x) for x in lengths), max(lengths))


# Read as a plain global in the forward (dynamo traced a resolver called there into every
# compiled layer). Set to False when the kernel fails once (then per-sample sdpa is used for the
# rest of the process).
_FLASH_VARLEN: bool = HAS_FLASH_VARLEN


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_seq_info: PackedSeqInfo | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each packed sample; returns ``([1, T, H, D], None)``."""
    if packed_seq_info is None or not getattr(module, "is_causal", True) or query.shape[0] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("packed attention does not implement dropout")
    global _FLASH_VARLEN
    if _FLASH_VARLEN and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H, D]
        cu, m = packed_seq_info.cu_seqlens, packed_seq_info.max_seqlen
        if torch.compiler.is_compiling():  # no try/except in the traced graph
            return flash_varlen(q, k, v, cu, m, causal=True, scale=scaling).unsqueeze(0), None
        try:
            return flash_varlen(q, k, v, cu, m, causal=True, scale=scaling).unsqueeze(0), None
        except (RuntimeError, NotImplementedError) as err:
            # An unsupported shape / build: use per-sample sdpa from now on, say so once.
            logger.warning("flash varlen attention failed (%s); using per-sample sdpa", err)
            _FLASH_VARLEN = False
    n_rep = query.shape[1] // key.shape[1]
    # a real bool: under torch.compile(dynamic=True) the head counts are symbolic, and sdpa's
    # enable_gqa does not take a SymBool (it broke the graph); branching specializes it.
    gqa = True if n_rep > 1 else False  # noqa: SIM210
    # split (not slicing): its backward concatenates the gradients once instead of
    # materialising a zero-filled full-size gradient per sample.
    # Indexing, not zip(): dynamo could not trace zip over the split tuples.
    lengths = list(packed_seq_info.lengths)
    qs, ks, vs = (t.split(lengths, dim=2) for t in (query, key, value))
    outs = [
        F.scaled_dot_product_attention(
            qs[i], ks[i], vs[i], is_causal=True, scale=scaling, enable_gqa=gqa
        )
        for i in range(len(lengths))
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> str:
    """Register the ``"packed"`` attention backend with transformers (idempotent)."""
    # No mask function: for a backend without one transformers builds no mask at all. (With
    # one it first scans position_ids for packed sequences, a host sync per forward.)
    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    return PACKED_ATTENTION
