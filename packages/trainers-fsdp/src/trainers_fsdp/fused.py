"""Fused replacements for elementwise-heavy transformers modules, checked against the originals.

transformers' Qwen3 RMSNorm upcasts the whole activation to float32 and runs about eight
separate kernels forward (cast, pow, mean, add, rsqrt, mul, cast, mul) and more backward. A
Qwen3-VL decoder layer has four of them (input, post-attention, per-head q and k norms), so on
8k tokens they are a large share of the step's memory traffic and kernel launches.
``torch.nn.functional.rms_norm`` computes the same thing (float32 accumulation) in one fused
kernel each way on CUDA. The only numerical difference: the normalised activation is not
rounded to bf16 before the weight multiply (one rounding instead of two).

Each module class is swapped only after a probe shows the fused forward equals the original on
a random input, so a norm with another formula (e.g. ``(1 + weight)`` scaling) is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def _fused_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` in one kernel (float32 inside, input dtype out)."""
    weight = self.weight
    if weight.dtype != hidden_states.dtype:  # e.g. fp32 weight on bf16 input: keep HF's rule
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


@torch.no_grad()
def _probe(cls: type[nn.Module], module: nn.Module) -> bool:
    """True when the fused forward matches ``cls.forward`` (float32, random input and weight)."""
    dim = module.weight.shape[0]
    probe = cls.__new__(cls)
    nn.Module.__init__(probe)
    probe.weight = nn.Parameter(torch.rand(dim, dtype=torch.float32) + 0.5)
    probe.variance_epsilon = module.variance_epsilon
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
    try:
        expected = cls.forward(probe, x)
    except Exception as err:  # an unknown norm: leave it as it is
        logger.debug("RMSNorm probe of %s failed: %s", cls.__name__, err)
        return False
    got = _fused_rms_norm_forward(probe, x)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-6)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` whose formula the probe confirms the fused forward.

    Parameters and names are unchanged (only the instance's ``forward`` is replaced), so
    checkpoints, FSDP and weight export see the same module. Returns how many were fused.
    """
    verdict: dict[type, bool] = {}
    fused = 0
    for module in model.modules():
        if not _is_rms_norm(module):
            continue
        cls = type(module)
        if cls not in verdict:
            verdict[cls] = _probe(cls, module)
            if not verdict[cls]:
                logger.info("%s left unfused: its formula differs from rms_norm", cls.__name__)
        if verdict[cls]:
            module.forward = MethodType(_fused_rms_norm_forward, module)
            fused += 1
    logger.info("fused %d RMSNorm modules", fused)
    return fused


# ------------------------------------------------------------------------------- vision attention
_VISION_LENGTHS: ContextVar[tuple[int, ...] | None] = ContextVar("vision_lengths", default=None)


@contextmanager
def vision_seqlens(lengths: list[int] | None) -> Iterator[None]:
    """Tell the fused vision attention each image's patch count (host ints) for one forward,
    so it need not read ``cu_seqlens`` back from the device in every block."""
    token = _VISION_LENGTHS.set(None if lengths is None else tuple(lengths))
    try:
        yield
    finally:
        _VISION_LENGTHS.reset(token)


def vision_lengths(grid_thw: torch.Tensor | None) -> list[int] | None:
    """Per-frame patch counts of ``image_grid_thw`` (host), the spans vision attention uses."""
    if grid_thw is None:
        return None
    return [int(h * w) for t, h, w in grid_thw.tolist() for _ in range(int(t))]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _vision_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rotary_pos_emb: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """Qwen3-VL vision attention with the rotary embedding in the activation dtype (not a
    float32 copy of q and k) and all images in one varlen kernel (not one sdpa per image after
    a ``cu_seqlens.tolist()`` host sync in every block)."""
    from trainers_fsdp import attention

    t = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(t, 3, self.num_heads, -1).unbind(1)  # [T, H, D]
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    lengths = _VISION_LENGTHS.get()
    if lengths is None or sum(lengths) != t:
        lengths = tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
    varlen = attention._VARLEN
    if varlen is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        cu = cu_seqlens.to(torch.int32)
        longest = max(lengths)
        out = varlen.fn(q, k, v, cu, cu, longest, longest, scale=self.scaling)
    else:
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


@torch.no_grad()
def _probe_vision_attention(module: nn.Module) -> bool:
    """True when the fused forward equals the module's own on a small float32 input."""
    dim, head_dim = module.qkv.in_features, module.head_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, dim, generator=gen, dtype=module.qkv.weight.dtype)
    emb = torch.randn(7, head_dim, generator=gen, dtype=x.dtype)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    pe = (emb.cos(), emb.sin())
    try:
        expected = type(module).forward(module, x, cu_seqlens=cu, position_embeddings=pe)
    except Exception as err:
        logger.debug("vision attention probe of %s failed: %s", type(module).__name__, err)
        return False
    got = _vision_attention_forward(module, x, cu_seqlens=cu, position_embeddings=pe)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-4, atol=1e-5)


def fuse_vision_attention(model: nn.Module) -> int:
    """Give each Qwen3-VL vision attention the fused forward, when the probe confirms it matches
    (a transformers version with another layout is left alone). Returns how many."""
    fused = 0
    verdict: dict[type, bool] = {}
    for module in model.modules():
        cls = type(module)
        if not (cls.__name__.endswith("VisionAttention") and hasattr(module, "qkv")):
            continue
        if cls not in verdict:
            verdict[cls] = _probe_vision_attention(module)
            if not verdict[cls]:
                logger.info("%s left unfused: the probe did not match", cls.__name__)
        if verdict[cls]:
            module.forward = MethodType(_vision_attention_forward, module)
            fused += 1
    logger.info("fused %d vision attention modules", fused)
    return fused
