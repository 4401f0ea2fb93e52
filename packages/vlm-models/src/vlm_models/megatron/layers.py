"""Layer specs for the Qwen3-VL and Qwen3.5 language models on Megatron-Core.

Small modules complete Megatron's local (non-Transformer-Engine) layer spec:

* :class:`RMSNorm` computes exactly what HF's ``Qwen3VLTextRMSNorm`` computes (normalise in
  float32, cast back, then scale), or Qwen3.5's zero-centred ``(1 + weight)`` norm, and, unlike
  ``WrappedTorchNorm``, works with sequence parallelism (its weight is marked so Megatron
  all-reduces its gradient over TP).
* :class:`SDPACoreAttention` is core attention on ``torch.nn.functional.scaled_dot_product_attention``
  that also takes packed THD sequences (``PackedSeqParams``), which the local
  ``DotProductAttention`` refuses: on CUDA in half precision all samples in one FlashAttention
  varlen kernel (the FSDP path's kernel, :func:`vlm_models.flash_varlen`), elsewhere one SDPA
  call per sample.
* :class:`DeepstackTransformerLayer` adds Qwen3-VL's deepstack visual features after the first
  decoder layers. The features travel through the block as its ``context`` argument (a dense
  ``[S, B, n_deepstack, H]`` tensor, zero away from image tokens), because the block already
  hands ``context`` to every layer, through activation recomputation too. Cross-attention is not
  used by this model, so nothing else reads it.
* Qwen3.5: :class:`GatedSelfAttention` (megatron-core's ``attention_output_gate``) for the full
  attention layers and :class:`~vlm_models.megatron.gated_delta_net.PackedGatedDeltaNet` for
  the linear-attention ones, chosen per layer by megatron-core's ``linear_attention_freq``
  pattern (``get_linear_attention_pattern``; its own hybrid block spec needs TE).
* MoE experts: :class:`~vlm_models.megatron.experts.GroupedExperts` (``SequentialMLP``'s
  parameters, two grouped GEMMs) where the config asks for ``moe_grouped_gemm``.

With Transformer Engine installed, ``use_te=True`` takes TE's fused modules instead and keeps
only the deepstack layer.
"""

from __future__ import annotations

import copy
import itertools
import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from torch import Tensor, nn

from vlm_models.varlen import flash_varlen, flash_varlen_supported


def param_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class RMSNorm(nn.Module):
    """RMSNorm with HF Qwen3 / Qwen3.5 numerics; sequence-parallel aware.

    ``zero_centered`` (default: the config's ``layernorm_zero_centered_gamma``) is Qwen3.5's
    ``Qwen3_5RMSNorm``: the weight is stored around 0 and scales by ``1 + weight``, in float32
    before the cast back, as HF computes it.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        zero_centered: bool | None = None,
        **_: object,
    ) -> None:
        super().__init__()
        self.eps = eps
        if zero_centered is None:
            zero_centered = config.layernorm_zero_centered_gamma
        self.zero_centered = zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device=param_device(config))
        )
        # Megatron's finalize_model_grads all-reduces grads of params marked this way over TP.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        if self.zero_centered:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # F.rms_norm normalises in float32 and rounds to x's dtype (one fused kernel on CUDA),
        # then the weight multiplies: the same roundings as HF's eager formula.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class SDPACoreAttention(MegatronModule):
    """Causal core attention on torch SDPA, for ``sbhd`` batches and packed ``thd`` sequences.

    Inputs are Megatron's per-partition heads: query ``[s, b, np, hn]`` (or ``[t, np, hn]``
    packed), key/value with ``ng`` query groups. Output ``[s, b, np * hn]`` (or ``[t, np * hn]``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        self.context_parallel = config.context_parallel_size > 1
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q ``[b, np, s, hn]``, k/v ``[b, ng, s, hn]``; causal unless ``mask`` is given."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and self.attn_mask_type == AttnMaskType.causal,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")
        zigzag = getattr(packed_seq_params, "zigzag", None)
        if zigzag is not None:
            return self._forward_zigzag(query, key, value, zigzag)
        if self.context_parallel:
            raise ValueError("context parallelism needs packed rows split by ZigzagLayout")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params)
        # Megatron's mask is True where attention is NOT allowed; SDPA's is True where it is.
        mask = None if attention_mask is None else ~attention_mask.bool()
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        out = self._attend(q, k, v, mask)  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _forward_thd(
        self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams
    ) -> Tensor:
        if flash_varlen_supported(query) and not (self.training and self.dropout):
            # one kernel for every sample; no host read of the boundaries (max_seqlen is an int)
            padded = params.cu_seqlens_q_padded
            cu = padded if padded is not None else params.cu_seqlens_q
            longest = params.max_seqlen_q
            if longest is None:
                longest = int((cu[1:] - cu[:-1]).max())
            out = flash_varlen(
                query, key, value, cu, int(longest), causal=True, scale=self.softmax_scale
            )
            return out.reshape(query.shape[0], -1)
        padded = params.cu_seqlens_q_padded
        cu_tensor = padded if padded is not None else params.cu_seqlens_q
        if torch.compiler.is_compiling():  # compiled (CPU): a block-causal mask, no host read
            return self._forward_thd_masked(query, key, value, cu_tensor)
        cu = cu_tensor.tolist()
        if cu[0] != 0 or cu[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens {cu} do not cover the {query.shape[0]} packed tokens")
        parts = [
            self._attend(*(x[start:end].transpose(0, 1)[None] for x in (query, key, value)), None)
            for start, end in itertools.pairwise(cu)
            if end > start
        ]
        out = torch.cat([p[0].transpose(0, 1) for p in parts])  # [t, np, hn]
        return out.reshape(query.shape[0], -1)

    def _forward_zigzag(self, query: Tensor, key: Tensor, value: Tensor, zigzag) -> Tensor:
        """Context parallel: this rank's queries (two chunks of each sample) against the
        sample's keys and values all-gathered over CP, causal by position in the sample.

        One all-gather of K and V together per layer (backward: reduce-scatter of their
        gradients); K/V of the whole row are held during the layer. Per sample, one SDPA call
        under an explicit mask (no varlen kernel for queries and keys of different spans here).
        """
        heads = key.shape[1]
        kv = zigzag.gather(torch.cat([key, value], dim=1))  # [P, 2 ng, hn], padded row order
        k_all, v_all = kv[:, :heads], kv[:, heads:]
        starts = zigzag.padded_cu
        parts = []
        for sample in range(len(zigzag.padded_lengths)):
            offset, pos = zigzag.local_span(sample)
            end = int(pos[-1]) + 1  # the later chunk ends last: keys beyond it are never read
            pos = pos.to(query.device)
            mask = torch.arange(end, device=query.device)[None, :] <= pos[:, None]
            q = query[offset : offset + len(pos)]
            k = k_all[starts[sample] : starts[sample] + end]
            v = v_all[starts[sample] : starts[sample] + end]
            out = self._attend(*(x.transpose(0, 1)[None] for x in (q, k, v)), mask)
            parts.append(out[0].transpose(0, 1))
        return torch.cat(parts).reshape(query.shape[0], -1)

    def _forward_thd_masked(self, query: Tensor, key: Tensor, value: Tensor, cu: Tensor) -> Tensor:
        """All samples in one SDPA call under a block-causal ``[T, T]`` mask built on the
        device: quadratic memory, so only where no varlen kernel runs (traced CPU layers)."""
        t = query.shape[0]
        positions = torch.arange(t, device=query.device)
        sample = torch.searchsorted(cu[1:].to(positions.dtype), positions, right=True)
        mask = (sample[:, None] == sample[None, :]) & (positions[:, None] >= positions[None, :])
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, heads, t, hn]
        out = self._attend(q, k, v, mask)
        return out[0].transpose(0, 1).reshape(t, -1)


class GatedSelfAttention(SelfAttention):
    """megatron-core's self-attention with ``attention_output_gate`` (Qwen3.5's per-head
    ``sigmoid(gate)`` on the attention output), whose gate runs eagerly off CUDA: megatron-core
    wraps it in ``torch.compile`` (its jit fuser), which on a CPU means a C++ build per shape."""

    def _apply_output_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        if x.is_cuda:
            return super()._apply_output_gate(x, gate)
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


class DeepstackTransformerLayer(TransformerLayer):
    """A decoder layer that adds deepstack visual features to its output.

    ``context`` is ``[S, B, n_deepstack, H]`` (sequence-sharded like the hidden states under
    sequence parallelism) or None. Global layer ``k`` (0-based) adds ``context[:, :, k]`` when
    ``k < n_deepstack``, as HF's ``Qwen3VLTextModel`` does after its layer ``k``.

    ``layer_forward`` is megatron-core's layer itself; :func:`compile_decoder_layers` replaces
    it with one compiled function shared by all layers. The deepstack add stays outside it:
    it branches on the layer number, which a compiled region would specialise on, compiling
    every layer anew (and past dynamo's recompile limit, running the rest eagerly).
    """

    layer_forward = None  # set per instance by compile_decoder_layers

    def forward(self, *args, context: Tensor | None = None, **kwargs):
        if self.layer_forward is not None:
            hidden_states, _ = self.layer_forward(self, *args, context=None, **kwargs)
        else:
            hidden_states, _ = super().forward(*args, context=None, **kwargs)
        index = self.layer_number - 1  # layer_number is global and 1-based
        if context is not None and index < context.shape[2]:
            hidden_states = hidden_states + context[:, :, index].to(hidden_states.dtype)
        return hidden_states, context


def layer_spec(
    config: TransformerConfig,
    *,
    use_te: bool = False,
    linear_attention: bool = False,
    gdn_path: str = "auto",
) -> ModuleSpec:
    """A decoder layer: GQA + per-head RMS QK-norm (Qwen3.5: with the output gate), or
    (``linear_attention``) Qwen3.5's gated delta net; SwiGLU or MoE (with a gated shared
    expert where the config has one); RMSNorm."""
    num_experts = config.num_moe_experts
    if use_te and (linear_attention or config.attention_output_gate):
        raise NotImplementedError(
            "Qwen3.5 layers are built on the local spec only (use_te=False); TE's are not mapped"
        )
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=True, moe_grouped_gemm=config.moe_grouped_gemm
        )
        spec = copy.deepcopy(spec)
        spec.module = DeepstackTransformerLayer
        return spec

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=num_experts, qk_layernorm=True, normalization="RMSNorm"
        )
    )
    spec.module = DeepstackTransformerLayer
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if num_experts and config.moe_grouped_gemm:
        from vlm_models.megatron.experts import GroupedExperts

        sub.mlp.submodules.experts.module = GroupedExperts
    if linear_attention:
        from vlm_models.megatron.gated_delta_net import gated_delta_net_spec

        sub.self_attention = gated_delta_net_spec(RMSNorm, path=gdn_path)
        return spec
    if config.attention_output_gate:
        sub.self_attention.module = GatedSelfAttention
    attn = sub.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    attn.q_layernorm = RMSNorm
    attn.k_layernorm = RMSNorm
    return spec


def block_spec(
    config: TransformerConfig,
    *,
    use_te: bool = False,
    vp_stage: int | None = None,
    gdn_path: str = "auto",
) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage plus the final RMSNorm. A hybrid config (Qwen3.5)
    gets a gated delta net where megatron-core's ``linear_attention_freq`` pattern says 1."""
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    final_norm: type[nn.Module] = RMSNorm
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    if config.experimental_attention_variant != "gated_delta_net":
        specs = [layer_spec(config, use_te=use_te)] * num_layers
    else:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_linear_attention_pattern,
        )

        pattern = get_linear_attention_pattern(config)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        specs = [
            layer_spec(config, use_te=use_te, linear_attention=bool(pattern[i]), gdn_path=gdn_path)
            for i in range(offset, offset + num_layers)
        ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)
