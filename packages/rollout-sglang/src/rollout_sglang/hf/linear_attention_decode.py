"""Qwen3.5's layers for the decode step: gated-delta-net (linear attention) with per-slot state,
and the gated full attention's projections.

Why per-slot state: a gated-delta-net layer keeps no keys; its memory of the prefix is a short
convolution window (the last ``kernel`` pre-conv q/k/v projections) and a recurrent state
``[v_heads, k_dim, v_dim]`` per sequence. :class:`LinearStates` holds both for every slot of the
KV cache (allocated and moved with it); prefill copies transformers' cache states in, and each
decode step updates them in place, so the step stays fixed-shape and capturable.

What it computes is transformers' ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` for one
cached token: ``causal_conv1d_update`` (window shift, depthwise conv, SiLU), q/k L2-normalised in
float32, q scaled by ``k_dim ** -0.5``, the state decayed by ``exp(g)``, the delta rule
``S += k (beta (v - S^T k))^T``, output ``S^T q``, then the gated RMSNorm (``norm(o) * silu(z)``)
and the output projection. The recurrence is :data:`recurrent_step`, plain torch: fla's fused
recurrent kernel is the drop-in for it on GPU (same inputs, in-place state), not installed here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def is_linear_attention(layer: nn.Module) -> bool:
    """True for a Qwen3.5 gated-delta-net layer."""
    attn = getattr(layer, "linear_attn", None)
    return attn is not None and all(
        hasattr(attn, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d")
    )


def rms_norm_zero_centred(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's RMSNorm: normalise in float32, scale by ``1 + weight`` in float32, cast back."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).type_as(x)


class LinearStates:
    """Conv windows ``[layers, slots, conv_dim, kernel]`` (model dtype) and recurrent states
    ``[layers, slots, v_heads, k_dim, v_dim]`` (float32, as transformers keeps them) of every
    gated-delta-net layer, one per KV-cache slot. Sized by :meth:`fit` when the cache's slot
    count changes; per slot, not per token, so they cost ``bytes_per_slot`` each."""

    def __init__(
        self,
        *,
        num_layers: int,
        conv_dim: int,
        kernel: int,
        v_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.conv_dim, self.kernel = num_layers, conv_dim, kernel
        self.v_heads, self.k_dim, self.v_dim = v_heads, k_dim, v_dim
        self.dtype, self.device = dtype, device
        self.slots = 0
        self.conv: Tensor | None = None
        self.recurrent: Tensor | None = None

    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * self.kernel * torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * (conv + 4 * self.v_heads * self.k_dim * self.v_dim)

    def fit(self, slots: int) -> None:
        """Zeroed states for ``slots`` slots (the cache's layout changed: contents are stale)."""
        if slots == self.slots and self.conv is not None:
            return
        self.conv = torch.zeros(
            (self.num_layers, slots, self.conv_dim, self.kernel),
            dtype=self.dtype,
            device=self.device,
        )
        self.recurrent = torch.zeros(
            (self.num_layers, slots, self.v_heads, self.k_dim, self.v_dim),
            dtype=torch.float32,
            device=self.device,
        )
        self.slots = slots

    def write_prefill(self, layer: int, slots: Tensor, conv: Tensor, recurrent: Tensor) -> None:
        """A prefill's final states (transformers' cache layer ``conv_states[0]`` ``[B, conv_dim,
        kernel]`` and ``recurrent_states[0]`` ``[B, v_heads, k_dim, v_dim]``) into ``slots``."""
        assert self.conv is not None and self.recurrent is not None
        self.conv[layer, slots] = conv.to(self.dtype)
        self.recurrent[layer, slots] = recurrent.float()

    def move(self, src: Tensor, dst: Tensor) -> None:
        assert self.conv is not None and self.recurrent is not None
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    def release(self) -> None:
        self.conv = self.recurrent = None
        self.slots = 0


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers' (and fla's) ``l2norm``: ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def torch_recurrent_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> Tensor:
    """One token of the gated delta rule, all float32: ``q``, ``k`` ``[B, H, Dk]`` (L2-normed, q
    scaled), ``v`` ``[B, H, Dv]``, ``g``, ``beta`` ``[B, H]``; ``state`` ``[B, H, Dk, Dv]`` is
    updated in place. Returns the output ``[B, H, Dv]``."""
    s = state * g.exp()[..., None, None]
    kv_mem = (s * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    state.copy_(s)
    return (s * q[..., None]).sum(-2)


# The hook for a fused kernel (fla's fused recurrent gated delta rule on GPU): same arguments,
# the state updated in place.
recurrent_step: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] = (
    torch_recurrent_step
)


def gated_delta_net_step(
    attn: nn.Module,
    x: Tensor,
    conv_state: Tensor,
    recurrent_state: Tensor,
    *,
    trace: dict[str, Tensor] | None = None,
) -> Tensor:
    """The layer's output for one token per row. ``x`` [B, hidden] (input-normed);
    ``conv_state`` [B, conv_dim, kernel] and ``recurrent_state`` [B, v_heads, k_dim, v_dim] are
    the batch's slot views, updated in place. ``trace`` (eager steps): receives the conv output
    (after SiLU), the recurrence's output, the gate ``z`` and the gated norm's output, under the
    names the microscope compares with transformers' forward."""
    batch = x.shape[0]
    k_heads, v_heads = attn.num_k_heads, attn.num_v_heads
    k_dim, v_dim = attn.head_k_dim, attn.head_v_dim
    qkv = F.linear(x, attn.in_proj_qkv.weight)
    z = F.linear(x, attn.in_proj_z.weight)
    b = F.linear(x, attn.in_proj_b.weight)
    a = F.linear(x, attn.in_proj_a.weight)
    # causal_conv1d_update: shift the window, one depthwise dot product per channel, SiLU
    window = torch.cat((conv_state[:, :, 1:], qkv[:, :, None].to(conv_state.dtype)), dim=-1)
    conv_state.copy_(window)
    weight = attn.conv1d.weight.squeeze(1)  # [conv_dim, kernel]
    # products summed in float32 and rounded once, as F.conv1d (the prefill's and the
    # trainers' conv) does: bf16 products rounded one by one drift ~1.5x further from it
    mixed = (window.float() * weight.float()).sum(-1).to(weight.dtype)
    if attn.conv1d.bias is not None:
        mixed = mixed + attn.conv1d.bias
    mixed = F.silu(mixed).to(x.dtype)
    q, k, v = torch.split(mixed, [attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    q, k = q.reshape(batch, k_heads, k_dim), k.reshape(batch, k_heads, k_dim)
    v = v.reshape(batch, v_heads, v_dim)
    beta = b.sigmoid()
    g = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
    if v_heads // k_heads > 1:
        q = q.repeat_interleave(v_heads // k_heads, dim=1)
        k = k.repeat_interleave(v_heads // k_heads, dim=1)
    q, k = _l2norm(q.float()), _l2norm(k.float())
    q = q / (k_dim**0.5)
    out = recurrent_step(q, k, v.float(), g.float(), beta.float(), recurrent_state)
    out = out.to(x.dtype)
    # gated RMSNorm (weight init ones, not zero-centred): norm in float32, scale, * silu(z)
    normed = attn.norm.weight * F.rms_norm(
        out.float(), (v_dim,), eps=attn.norm.variance_epsilon
    ).to(x.dtype)
    gated = (normed * F.silu(z.reshape(batch, v_heads, v_dim).float())).to(x.dtype)
    if trace is not None:
        trace.update(conv=mixed, recurrent=out.reshape(batch, -1), gate=z, gated=gated)
    return F.linear(gated.reshape(batch, v_heads * v_dim), attn.out_proj.weight)


def gated_attention_pre(
    attn: nn.Module,
    x: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    rotate: Callable[[Tensor, Tensor, Tensor], Tensor],
    eps: float,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Qwen3.5 full attention before the cache: ``q_proj`` gives each head's query and its
    output gate side by side, q/k zero-centred RMSNorm per head, rotary on the first
    ``cos.shape[-1]`` dims of each head (partial rotary), the rest passed through.
    Returns q ``[B, heads, D]``, k, v ``[B, kv_heads, D]``, gate ``[B, heads * D]``."""
    batch = x.shape[0]
    q, gate = F.linear(x, attn.q_proj.weight).view(batch, -1, 2 * head_dim).chunk(2, dim=-1)
    q = rms_norm_zero_centred(q, attn.q_norm.weight, eps)
    k = rms_norm_zero_centred(
        F.linear(x, attn.k_proj.weight).view(batch, -1, head_dim), attn.k_norm.weight, eps
    )
    v = F.linear(x, attn.v_proj.weight).view(batch, -1, head_dim)
    rot = cos.shape[-1]
    q = torch.cat((rotate(q[..., :rot], cos, signed_sin), q[..., rot:]), dim=-1)
    k = torch.cat((rotate(k[..., :rot], cos, signed_sin), k[..., rot:]), dim=-1)
    return q, k, v, gate.reshape(batch, -1)
