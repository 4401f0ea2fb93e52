"""Qwen3-VL's vision attention without float32 rotary copies or a kernel per image.

:class:`FusedVisionAttention` is the forward of the model files' vision attention classes: it
applies the rotary embedding in the activation dtype (not a float32 copy of q and k) and runs
all images in one varlen kernel, sized by the ``max_seqlen`` keyword
(:class:`vlm_models.VisionInputs` passes it) rather than a device read per block. A
transformers class whose layout differs keeps its own forward: :meth:`layout_matches` compares
the two first. Both trainers use it (the FSDP model and the Megatron model's HF vision tower).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlm_models.classes import Ours
from vlm_models.varlen import flash_varlen, flash_varlen_supported

logger = logging.getLogger(__name__)


def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` written on the two halves (no negated copy)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out1 = x1 * cos[..., :half] - x2 * sin[..., :half]
    out2 = x2 * cos[..., half:] + x1 * sin[..., half:]
    return torch.cat((out1, out2), dim=-1)


class FusedVisionAttention(Ours, nn.Module):
    """Mixin before transformers' ``*VisionAttention`` (``qkv``, ``proj``, ``num_heads``,
    ``head_dim``, ``scaling``): the forward below replaces theirs; no parameters added."""

    def forward(
        self,
        hidden_states: Tensor,
        cu_seqlens: Tensor,
        rotary_pos_emb: Tensor | None = None,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs,
    ) -> Tensor:
        """Qwen3-VL vision attention: bf16 rotary, all images in one varlen kernel on CUDA."""
        t = hidden_states.shape[0]
        # q, k and v as three GEMMs on slices of the fused weight: the backward then sums three
        # input gradients instead of concatenating them into one [T, 3 * dim] tensor, a cat that
        # compiled together with the rotary backward ran about 20x slower than its memory traffic.
        n = self.qkv.out_features // 3
        w, b = self.qkv.weight, self.qkv.bias
        q, k, v = (
            F.linear(
                hidden_states, w[i * n : (i + 1) * n], None if b is None else b[i * n : (i + 1) * n]
            ).view(t, self.num_heads, -1)
            for i in range(3)
        )
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        if flash_varlen_supported(q):
            cu = cu_seqlens.to(torch.int32)
            if max_seqlen is None:  # not precomputed: one device read
                max_seqlen = int((cu[1:] - cu[:-1]).max())
            out = flash_varlen(q, k, v, cu, max_seqlen, causal=False, scale=self.scaling)
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            outs = [
                F.scaled_dot_product_attention(
                    a.transpose(0, 1)[None],
                    b.transpose(0, 1)[None],
                    c.transpose(0, 1)[None],
                    scale=self.scaling,
                )[0].transpose(0, 1)
                for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths))  # noqa: B905
            ]
            out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self.proj(out.reshape(t, -1))

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        """Whether our forward equals ``theirs`` on a small float32 input (see :func:`_probe`)."""
        return _probe(theirs, cls, module)


@torch.no_grad()
def _probe(theirs: type, ours: type, module: nn.Module) -> bool:
    """True when ``ours``' forward equals the module's own on a small float32 input.

    Probed on a float32 CPU copy, so a module already on the GPU in bf16 (the Megatron
    model's tower is built there) is judged by its layout, not by rounding or device."""
    module = copy.deepcopy(module).to("cpu", torch.float32)
    dim, head_dim = module.qkv.in_features, module.head_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, dim, generator=gen, dtype=module.qkv.weight.dtype)
    emb = torch.randn(7, head_dim, generator=gen, dtype=x.dtype)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    pe = (emb.cos(), emb.sin())
    try:
        expected = theirs.forward(module, x, cu_seqlens=cu, position_embeddings=pe)
    except Exception as err:
        logger.debug("vision attention probe of %s failed: %s", theirs.__name__, err)
        return False
    module.__class__ = ours  # the copy only
    got = module(x, cu_seqlens=cu, position_embeddings=pe)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-4, atol=1e-5)
