"""One decode step of a Qwen3 text stack, written over the transformers model's own weights.

Why our own forward: transformers' decode step launches hundreds of small kernels from Python
and rebuilds masks and positions each step; at rollout batch sizes the GPU waits on the host.
This step is a fixed sequence of tensor ops over fixed-shape buffers (a batch bucket and a
KV-length bucket), so it can be captured once as a CUDA graph and replayed with one launch
(:mod:`~rollout_sglang.hf.decode_runner`).

What it reads: the HF modules' parameters themselves (never copies), so in-place weight
updates are seen by eager steps and by captured graphs alike. Four families: Qwen3-VL,
Qwen3-VL-MoE (the MoE block: :mod:`~rollout_sglang.hf.moe`), Qwen3.5 and Qwen3.5-MoE
(gated-delta-net layers with per-slot state and gated full attention:
:mod:`~rollout_sglang.hf.linear_attention_decode`). What it computes is the same as
transformers' Qwen3-VL text layer for a text token: RMSNorm, q/k RMSNorm per head, rotary
embedding at the request's own position (for text tokens the three M-RoPE rows are equal, which
makes interleaved M-RoPE plain RoPE), grouped-query attention over the slot's cached keys
(the query heads of one KV head read as that head's "query positions", so no KV repeat),
SwiGLU MLP, final norm and LM head; then sampling and the token's log-prob
(:func:`~rollout_sglang.hf.sampling.sample_with_uniform`), all on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollout_sglang.hf.kv_cache import KVCache
from rollout_sglang.hf.linear_attention_decode import (
    LinearStates,
    gated_attention_pre,
    gated_delta_net_step,
    is_linear_attention,
    rms_norm_zero_centred,
)
from rollout_sglang.hf.moe import grouped_mm_available, is_moe, moe_forward
from rollout_sglang.hf.sampling import SamplingKey, sample_logits

logger = logging.getLogger(__name__)

ATTENTIONS = ("triton", "sdpa", "matmul")


def _text_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(text model, lm_head) of a ``*ForConditionalGeneration``, or None."""
    inner = getattr(model, "model", None)
    text = getattr(inner, "language_model", None)
    head = getattr(model, "lm_head", None)
    if text is None or head is None:
        return None
    return text, head


def _is_attention(layer: nn.Module) -> bool:
    attn = getattr(layer, "self_attn", None)
    return (
        attn is not None
        and all(hasattr(attn, n) for n in ("q_proj", "q_norm", "k_norm"))
        and getattr(attn.q_proj, "bias", None) is None
    )


def _is_dense_mlp(mlp: nn.Module | None) -> bool:
    return mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))


def is_qwen3_5(text: nn.Module) -> bool:
    """Qwen3.5 (dense or MoE) text stack: zero-centred norms, gated attention, linear layers."""
    return str(getattr(text.config, "model_type", "")).startswith("qwen3_5")


def supports(model: nn.Module) -> bool:
    """True for the four recipe families: Qwen3-VL and Qwen3-VL-MoE (attention in every layer),
    Qwen3.5 and Qwen3.5-MoE (gated-delta-net and gated full-attention layers); each layer's MLP
    a SwiGLU or a sparse MoE block. Anything else decodes through transformers
    (:mod:`rollout_sglang.hf.legacy`)."""
    parts = _text_parts(model)
    if parts is None:
        return False
    text, _ = parts
    hybrid = is_qwen3_5(text)
    for layer in getattr(text, "layers", []):
        if not (_is_attention(layer) or (hybrid and is_linear_attention(layer))):
            return False
        mlp = getattr(layer, "mlp", None)
        if not (_is_dense_mlp(mlp) or (mlp is not None and is_moe(mlp))):
            return False
    config = text.config
    return getattr(config, "hidden_act", "silu") == "silu" and len(text.layers) > 0


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' Qwen3 RMSNorm: normalise in float32, cast back, then scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE as transformers applies it, ``x * cos + rotate_half(x) * sin``, with the sign of
    ``rotate_half`` folded into ``signed_sin`` (``[-sin, sin]`` halves): a roll replaces the
    negate and the concatenation. (Not ``addcmul``: a fused multiply-add rounds once, and CPU
    kernels fuse only in their vector body, so a row's result would depend on the batch.)"""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _pre_attention(
    h: Tensor,
    ln: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    qn: Tensor,
    kn: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    eps: float,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Norm, q/k/v projections, per-head q/k norm, rotary: ``[B, heads, head_dim]`` each.

    q and k heads are normed and rotated as one tensor (each head with its own norm weight),
    so those elementwise kernels run once per layer, not twice."""
    x = _rms_norm(h, ln, eps)
    batch = h.shape[0]
    q = F.linear(x, wq).view(batch, -1, head_dim)
    k = F.linear(x, wk).view(batch, -1, head_dim)
    n_q, n_k = q.shape[1], k.shape[1]
    norm = torch.cat((qn.expand(n_q, head_dim), kn.expand(n_k, head_dim)))
    qk = _rotate(_rms_norm(torch.cat((q, k), dim=1), norm, eps), cos, signed_sin)
    v = F.linear(x, wv).view(batch, -1, head_dim)
    return qk[:, :n_q], qk[:, n_q:], v


def _post_attention(
    h: Tensor, attn: Tensor, wo: Tensor, ln: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, eps: float
) -> Tensor:
    """Output projection and residual, then norm, SwiGLU MLP and residual."""
    h = h + F.linear(attn, wo)
    x = _rms_norm(h, ln, eps)
    return h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


class TextDecoder:
    """The decode step over a model's text layers and a :class:`KVCache`.

    ``attention``: "triton" (:mod:`~rollout_sglang.hf.decode_attention`: a split-KV kernel that
    reads each slot's keys only up to its own length; CUDA, or Triton's interpreter), "sdpa"
    (torch's fused kernels over the batch's KV bucket with a length mask; the query heads of a
    KV head are its query rows, so no KV repeat) or "matmul" (two batched matmuls and a float32
    softmax over the same strided cache views). A Triton kernel that fails at its first run
    falls back to "sdpa" (:meth:`fall_back`). ``compile=True`` runs the two per-layer blocks of dense Qwen3-VL
    layers (everything but the cache write and the attention read) through ``torch.compile``
    with dynamic batch size, fusing their ~40 small kernels per layer; the graph then replays
    the fused kernels. MoE layers (:mod:`~rollout_sglang.hf.moe`; ``moe``: "auto" picks the
    grouped GEMM on CUDA, the dense form elsewhere) and Qwen3.5's layers
    (:mod:`~rollout_sglang.hf.linear_attention_decode`) run eagerly (or in the graph).
    Only attention layers own KV-cache layers (``kv_layers``: their model indices); Qwen3.5's
    gated-delta-net layers keep per-slot states (:meth:`linear_states`, held by the cache),
    which a step with ``dry_run`` set leaves untouched (graph warm-ups, probes).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        compile: bool = False,
        attention: str = "sdpa",
        moe: str = "auto",
    ) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"decode attention {attention!r}: one of {', '.join(ATTENTIONS)}")
        if moe not in ("auto", "dense", "grouped"):
            raise ValueError(f"decode moe {moe!r}: 'auto', 'dense' or 'grouped'")
        self.attention = attention
        # steps that must leave the slots' recurrent states as they found them (warm-ups)
        self.dry_run = False
        # eager steps only (the log-prob microscope, ``rollout_sglang.hf.microscope``): when a
        # dict, each step records every layer's output hidden states (``"hidden"``) and each
        # gated-delta-net layer's intermediates (``"gdn"``: layer -> name -> tensor) and each
        # MoE layer's chosen experts (``"moe"``: layer -> {"experts": ids})
        self.trace: dict[str, Any] | None = None
        # ``[slots, layers, k]`` (set by the runner when the engine returns routing): each
        # step writes every MoE layer's chosen experts of row ``b`` into ``routing[b, layer]``
        self.routing: Tensor | None = None
        self._triton_attend: Callable[..., Tensor] | None = None
        if attention == "triton":
            from rollout_sglang.hf.decode_attention import decode_attention

            self._triton_attend = decode_attention
        parts = _text_parts(model)
        if parts is None or not supports(model):
            raise ValueError(f"{type(model).__name__}: text layers the decode step does not cover")
        self.text, self.head = parts
        config = self.text.config
        layers = list(self.text.layers)
        self.hybrid = is_qwen3_5(self.text)
        self.kv_layers = [i for i, layer in enumerate(layers) if not is_linear_attention(layer)]
        self.linear_layers = [i for i, layer in enumerate(layers) if is_linear_attention(layer)]
        self._kv_index = {layer: j for j, layer in enumerate(self.kv_layers)}
        self._linear_index = {layer: j for j, layer in enumerate(self.linear_layers)}
        self.num_layers = len(self.kv_layers)  # KV-cache layers
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.eps = float(config.rms_norm_eps)
        self.scaling = self.head_dim**-0.5
        rotary = self.text.rotary_emb
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.moe_renormalise = getattr(config, "norm_topk_prob", None) is not False
        moe_layers = [layer.mlp for layer in layers if is_moe(getattr(layer, "mlp", None))]
        # (decoder layers, experts a token takes) of the routing a step records; None: dense
        self.routing_shape = (len(layers), int(moe_layers[0].gate.top_k)) if moe_layers else None
        self.moe_grouped = moe == "grouped" or (
            moe == "auto" and grouped_mm_available(self.head.weight.device, self.dtype)
        )
        self._pre: Callable[..., Any] = _pre_attention
        self._post: Callable[..., Any] = _post_attention
        self.compiled = compile
        if compile:
            self._pre = torch.compile(_pre_attention, dynamic=True)
            self._post = torch.compile(_post_attention, dynamic=True)

    def disable_compile(self) -> None:
        """Back to the eager blocks (a compile failure must not stop a rollout)."""
        self._pre, self._post, self.compiled = _pre_attention, _post_attention, False

    def fall_back(self, exc: Exception) -> bool:
        """Turn off what may fail to build on this machine after a failed step: the compiled
        blocks first, then the Triton attention (SDPA instead). False when nothing is left to
        turn off (the error is the step's own)."""
        if self.compiled:
            logger.warning("compiled decode step failed (%s); decoding without compile", exc)
            self.disable_compile()
            return True
        if self.attention == "triton":
            logger.warning("Triton decode attention failed (%s); decoding with SDPA", exc)
            self.attention = "sdpa"
            return True
        return False

    def linear_states(self, device: torch.device) -> LinearStates | None:
        """Per-slot states of the gated-delta-net layers (None without any)."""
        if not self.linear_layers:
            return None
        attn = self.text.layers[self.linear_layers[0]].linear_attn
        return LinearStates(
            num_layers=len(self.linear_layers),
            conv_dim=int(attn.conv_dim),
            kernel=int(attn.conv_kernel_size),
            v_heads=int(attn.num_v_heads),
            k_dim=int(attn.head_k_dim),
            v_dim=int(attn.head_v_dim),
            dtype=self.dtype,
            device=device,
        )

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """``q`` [B, kv_heads, group, D] over the live keys ``[B, kv_heads, kv_len, D]`` (views
        of the cache: neither path copies them)."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling
            )
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scaling
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
        return torch.matmul(probs, values)

    def _cache_attend(
        self,
        cache: KVCache,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lengths: Tensor,
        kv_len: int,
        mask: Tensor | None,
    ) -> Tensor:
        """Write this token's K/V at each row's ``length``, attend over ``0..length``:
        ``[B, heads * head_dim]``. (``mask``: the length mask over ``kv_len`` for SDPA and
        matmul; None for the Triton kernel, which reads ``lengths`` itself.)"""
        assert cache.keys is not None and cache.values is not None
        batch = q.shape[0]
        rows = torch.arange(batch, device=q.device)
        keys, values = cache.keys[self._kv_index[layer]], cache.values[self._kv_index[layer]]
        keys[rows, :, lengths] = k
        values[rows, :, lengths] = v
        group = self.num_heads // self.kv_heads
        q = q.reshape(batch, self.kv_heads, group, self.head_dim)
        if self.attention == "triton":
            assert self._triton_attend is not None
            out = self._triton_attend(q, keys, values, lengths, kv_len, self.scaling)
        else:
            if mask is None:
                mask = _length_mask(lengths, kv_len)
            out = self._attend(q, keys[:batch, :, :kv_len], values[:batch, :, :kv_len], mask)
        return out.reshape(batch, self.num_heads * self.head_dim)

    def _mlp(self, mlp: nn.Module, x: Tensor, layer: int) -> Tensor:
        """A layer's MLP on the normed ``x``: sparse MoE block or SwiGLU."""
        if is_moe(mlp):
            trace = None if self.trace is None else self.trace["moe"].setdefault(layer, {})
            record = None if self.routing is None else self.routing[: x.shape[0], layer]
            return moe_forward(
                mlp,
                x,
                grouped=self.moe_grouped,
                renormalise=self.moe_renormalise,
                trace=trace,
                record=record,
            )
        return F.linear(
            F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
            mlp.down_proj.weight,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin (see :func:`_rotate`) ``[B, 1, rotary_dim]`` at each row's
        position, as transformers computes them (float32 angles, scaled, cast to the
        activation dtype). ``rotary_dim`` is ``head_dim`` but for partial rotary (Qwen3.5)."""
        inv_freq = self.text.rotary_emb.inv_freq.to(positions.device, torch.float32)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos = (freqs.cos() * self.rope_scale).to(dtype)
        sin = (freqs.sin() * self.rope_scale).to(dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
        return torch.cat((cos, cos), dim=-1)[:, None, :], signed_sin

    def _qwen3_layer(
        self,
        i: int,
        layer: nn.Module,
        h: Tensor,
        cache: KVCache,
        rope: tuple[Tensor, Tensor],
        lengths: Tensor,
        kv_len: int,
        mask: Tensor | None,
    ) -> Tensor:
        """A Qwen3-VL(-MoE) layer: the dense path is the original compiled-block one."""
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = self._pre(
            h,
            layer.input_layernorm.weight,
            attn.q_proj.weight,
            attn.k_proj.weight,
            attn.v_proj.weight,
            attn.q_norm.weight,
            attn.k_norm.weight,
            *rope,
            self.eps,
            self.head_dim,
        )
        out = self._cache_attend(cache, i, q, k, v, lengths, kv_len, mask)
        if is_moe(mlp):
            h = h + F.linear(out, attn.o_proj.weight)
            x = _rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
            return h + self._mlp(mlp, x, i)
        return self._post(
            h,
            out,
            attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            mlp.gate_proj.weight,
            mlp.up_proj.weight,
            mlp.down_proj.weight,
            self.eps,
        )

    def _qwen3_5_layer(
        self,
        i: int,
        layer: nn.Module,
        h: Tensor,
        cache: KVCache,
        rope: tuple[Tensor, Tensor],
        lengths: Tensor,
        kv_len: int,
        mask: Tensor | None,
    ) -> Tensor:
        """A Qwen3.5(-MoE) layer: gated-delta-net over the slot states, or gated attention."""
        batch = h.shape[0]
        x = rms_norm_zero_centred(h, layer.input_layernorm.weight, self.eps)
        if i in self._linear_index:
            states = cache.states
            assert states is not None and states.conv is not None
            assert states.recurrent is not None
            j = self._linear_index[i]
            conv, recurrent = states.conv[j, :batch], states.recurrent[j, :batch]
            if self.dry_run:  # a copy takes the update: the slots' states stay as they are
                conv, recurrent = conv.clone(), recurrent.clone()
            parts = None if self.trace is None else self.trace["gdn"].setdefault(i, {})
            h = h + gated_delta_net_step(layer.linear_attn, x, conv, recurrent, trace=parts)
        else:
            attn = layer.self_attn
            q, k, v, gate = gated_attention_pre(attn, x, *rope, _rotate, self.eps, self.head_dim)
            out = self._cache_attend(cache, i, q, k, v, lengths, kv_len, mask)
            h = h + F.linear(out * torch.sigmoid(gate), attn.o_proj.weight)
        x = rms_norm_zero_centred(h, layer.post_attention_layernorm.weight, self.eps)
        return h + self._mlp(layer.mlp, x, i)

    def step(
        self,
        cache: KVCache,
        *,
        tokens: Tensor,
        positions: Tensor,
        lengths: Tensor,
        seeds: Tensor,
        counters: Tensor,
        kv_len: int,
        sampling: SamplingKey,
    ) -> tuple[Tensor, Tensor]:
        """Decode one token for slots ``0..B-1``.

        ``tokens`` [B] are the last tokens, ``positions`` [B] their rotary positions,
        ``lengths`` [B] their cache index (their K/V is written there; keys ``0..length``
        are attended), ``seeds`` / ``counters`` [B] pick each row's uniform. ``kv_len``
        bounds the keys read (a bucket >= every ``length + 1``). Returns (next tokens,
        their log-probs), [B] each. No host sync: capturable as a CUDA graph.
        """
        logits = self.logits(
            cache, tokens=tokens, positions=positions, lengths=lengths, kv_len=kv_len
        )
        return sample_logits(logits, seeds, counters, sampling)

    def logits(
        self, cache: KVCache, *, tokens: Tensor, positions: Tensor, lengths: Tensor, kv_len: int
    ) -> Tensor:
        """The step's float32 logits ``[B, vocab]`` (its arguments as :meth:`step`'s)."""
        if self.trace is not None:
            self.trace.setdefault("hidden", [])
            self.trace.setdefault("gdn", {})
            self.trace.setdefault("moe", {})
        h = F.embedding(tokens, self.text.embed_tokens.weight)
        rope = self._rope(positions, h.dtype)
        # the Triton kernel reads ``lengths`` itself; the others take one mask for all layers
        mask = None if self.attention == "triton" else _length_mask(lengths, kv_len)
        run_layer = self._qwen3_5_layer if self.hybrid else self._qwen3_layer
        for i, layer in enumerate(self.text.layers):
            h = run_layer(i, layer, h, cache, rope, lengths, kv_len, mask)
            if self.trace is not None:
                self.trace["hidden"].append(h)
        if self.hybrid:
            h = rms_norm_zero_centred(h, self.text.norm.weight, self.eps)
        else:
            h = _rms_norm(h, self.text.norm.weight, self.eps)
        return F.linear(h, self.head.weight).float()


def _length_mask(lengths: Tensor, kv_len: int) -> Tensor:
    """``[B, 1, 1, kv_len]``: key ``j`` of row ``b`` is live when ``j <= lengths[b]``."""
    kv = torch.arange(kv_len, device=lengths.device)
    return (kv[None, :] <= lengths[:, None])[:, None, None, :]
