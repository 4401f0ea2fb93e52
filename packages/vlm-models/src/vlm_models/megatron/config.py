"""Megatron-Core ``TransformerConfig`` for a Qwen3-VL or Qwen3.5 language model, from the HF config.

Qwen3.5 maps onto megatron-core's own fields: ``experimental_attention_variant="gated_delta_net"``
with a per-layer ``linear_attention_freq`` pattern and the ``linear_*`` sizes for its
gated-delta-net layers, ``attention_output_gate`` for the gated full-attention layers,
``layernorm_zero_centered_gamma`` for its ``(1 + weight)`` RMSNorms, and
``moe_shared_expert_intermediate_size`` / ``moe_shared_expert_gate`` for the gated shared expert.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parallelism:
    """How the language model is split. ``sp`` (sequence parallel) needs ``tp > 1``; ``etp``
    (expert tensor parallel: the TP split of each expert) defaults to ``tp``, megatron-core's
    default; the slime recipe's 35B-A3B layout is ``tp=2, ep=8, etp=1``. ``cp`` (context
    parallel) splits each packed row's tokens zigzag over ``cp`` ranks
    (:mod:`vlm_models.megatron.context_parallel`)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    etp: int | None = None
    cp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep, self.etp or 1, self.cp) < 1:
            raise ValueError(f"parallel sizes must be >= 1, got {self}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (sp=True) needs tp > 1")


@dataclass(frozen=True)
class TextArch:
    """The text-model facts the Megatron side needs, read once from an HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int]
    tie_word_embeddings: bool
    attention_bias: bool
    initializer_range: float
    num_experts: int | None = None
    moe_intermediate_size: int | None = None
    num_experts_per_tok: int | None = None
    deepstack_layers: int = 0
    #: per decoder layer, ``"full_attention"`` or ``"linear_attention"`` (Qwen3.5)
    layer_types: tuple[str, ...] = ()
    #: rotated dimensions of each head (Qwen3.5 rotates a quarter: ``partial_rotary_factor``)
    rotary_dim: int | None = None
    #: Qwen3.5: ``q_proj`` also emits a per-head gate, ``sigmoid(gate)`` scales the attention out
    attention_output_gate: bool = False
    #: Qwen3.5: RMSNorms scale by ``1 + weight`` (weights stored zero-centred)
    zero_centered_norms: bool = False
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    shared_expert_intermediate_size: int | None = None
    #: Qwen3.5-MoE: checkpoint files hold one tensor per expert (transformers stacks on load)
    per_expert_files: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        """Whether some decoder layers are gated-delta-net (linear attention) layers."""
        return "linear_attention" in self.layer_types

    def is_linear(self, layer: int) -> bool:
        """Whether global decoder layer ``layer`` (0-based) is a gated-delta-net layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def linear_qk_dim(self) -> int:
        """Width of the gated delta net's query (and key) projection."""
        return (self.linear_key_head_dim or 0) * (self.linear_num_key_heads or 0)

    @property
    def linear_v_dim(self) -> int:
        """Width of the gated delta net's value (and output-gate ``z``) projection."""
        return (self.linear_value_head_dim or 0) * (self.linear_num_value_heads or 0)


_QWEN3_5 = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


def text_arch(hf_config: PretrainedConfig) -> TextArch:
    """Read a Qwen3-VL or Qwen3.5 (dense or MoE) ``*Config`` into a :class:`TextArch`."""
    text = getattr(hf_config, "text_config", hf_config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not rope.get("mrope_interleaved", True):
        raise NotImplementedError("only Qwen3-VL's interleaved M-RoPE is supported")
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {rope.get('rope_type')!r} is not supported")
    qwen3_5 = getattr(text, "model_type", "") in _QWEN3_5
    layer_types = tuple(getattr(text, "layer_types", None) or ())
    if set(layer_types) - {"full_attention", "linear_attention"}:
        raise NotImplementedError(f"layer types {sorted(set(layer_types))} are not supported")
    if "linear_attention" in layer_types and not qwen3_5:
        raise NotImplementedError(
            f"linear-attention layers of {getattr(text, 'model_type', '?')!r} are not mapped; "
            "only Qwen3.5's gated delta net is"
        )
    vision = getattr(hf_config, "vision_config", None)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tie = bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings))
    num_experts = getattr(text, "num_experts", None)
    if num_experts and (
        getattr(text, "mlp_only_layers", None) or getattr(text, "decoder_sparse_step", 1) != 1
    ):
        raise NotImplementedError("MoE models with dense layers in between are not supported")
    return TextArch(
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=getattr(text, "intermediate_size", None) or text.moe_intermediate_size,
        vocab_size=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(theta),
        mrope_section=list(rope.get("mrope_section", [24, 20, 20])),
        tie_word_embeddings=tie,
        attention_bias=bool(getattr(text, "attention_bias", False)),
        initializer_range=getattr(text, "initializer_range", 0.02),
        num_experts=num_experts,
        moe_intermediate_size=getattr(text, "moe_intermediate_size", None) if num_experts else None,
        num_experts_per_tok=getattr(text, "num_experts_per_tok", None) if num_experts else None,
        deepstack_layers=len(getattr(vision, "deepstack_visual_indexes", None) or []),
        layer_types=layer_types,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        attention_output_gate=qwen3_5,
        zero_centered_norms=qwen3_5,
        linear_conv_kernel_dim=getattr(text, "linear_conv_kernel_dim", None) if qwen3_5 else None,
        linear_key_head_dim=getattr(text, "linear_key_head_dim", None) if qwen3_5 else None,
        linear_value_head_dim=getattr(text, "linear_value_head_dim", None) if qwen3_5 else None,
        linear_num_key_heads=getattr(text, "linear_num_key_heads", None) if qwen3_5 else None,
        linear_num_value_heads=getattr(text, "linear_num_value_heads", None) if qwen3_5 else None,
        per_expert_files=qwen3_5 and bool(num_experts),
        shared_expert_intermediate_size=(
            getattr(text, "shared_expert_intermediate_size", None) if num_experts else None
        ),
    )


def first_stage_layers(arch: TextArch, pp: int) -> int | None:
    """Decoder layers for the first of ``pp`` pipeline stages when an even split would leave
    deepstack layers (which add the vision tower's features) off it: the fewest that hold them
    and split the rest evenly over the other stages. None: the even split holds them."""
    if pp == 1 or arch.num_layers // pp >= arch.deepstack_layers:
        return None
    for first in range(arch.deepstack_layers, arch.num_layers):
        if (arch.num_layers - first) % (pp - 1) == 0 and arch.num_layers - first >= pp - 1:
            return first
    raise ValueError(
        f"{arch.num_layers} decoder layers cannot be split over {pp} pipeline stages with the "
        f"{arch.deepstack_layers} deepstack layers on the first"
    )


def transformer_config(
    hf_config: PretrainedConfig,
    parallel: Parallelism | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """A ``TransformerConfig`` for the language model of ``hf_config``.

    Fusions that need Apex or Transformer Engine are off (the local spec runs anywhere);
    ``overrides`` set any other ``TransformerConfig`` field (recompute, fusions with TE...).
    ``use_cpu_initialization`` defaults to True where CUDA is absent. With pipeline
    parallelism the first stage gets :func:`first_stage_layers` unless
    ``num_layers_in_first_pipeline_stage`` is given.
    """
    parallel = parallel or Parallelism()
    arch = text_arch(hf_config)
    if arch.vocab_size % parallel.tp:
        raise ValueError(
            f"vocab_size {arch.vocab_size} is not divisible by tp={parallel.tp}; Megatron would "
            "pad the vocabulary and change the softmax, so pick a tp that divides it"
        )
    if arch.num_kv_heads % parallel.tp:
        raise ValueError(
            f"num_key_value_heads {arch.num_kv_heads} not divisible by tp={parallel.tp}"
        )
    if arch.hybrid and (arch.linear_num_key_heads % parallel.tp):
        raise ValueError(
            f"linear_num_key_heads {arch.linear_num_key_heads} (gated delta net) not divisible "
            f"by tp={parallel.tp}"
        )
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        mrope_section=arch.mrope_section,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        context_parallel_size=1 if arch.hybrid else parallel.cp,  # hybrid: set below
        sequence_parallel=parallel.sp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        # Fusions below need Apex / TE / CUDA kernels; the local path keeps them off.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # MoE tokens: alltoall is the fast dispatcher with EP and the only one that takes token
        # counts that differ between EP ranks (data-parallel ranks pack their own samples) or
        # pipeline micro-batches of different lengths (megatron-core refuses allgather with
        # variable_seq_lengths, even for a dense model). Its CUDA streams have a stand-in in
        # the CPU compatibility layer.
        moe_token_dispatcher_type="alltoall",
    )
    if arch.num_experts:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_router_topk=arch.num_experts_per_tok,
            # softmax over all experts, top-k, renormalise == top-k then softmax over the k.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            # the experts as two grouped GEMMs (torch._grouped_mm) with SequentialMLP's
            # parameters: vlm_models.megatron.experts.GroupedExperts on the local spec,
            # TEGroupedMLP with Transformer Engine; False: one GEMM pair per expert
            moe_grouped_gemm=True,
            moe_aux_loss_coeff=0.0,
            # routing logits, softmax and the weighted sum of expert outputs in float32, as
            # slime runs Qwen3 / Qwen3.5 MoE (scripts/models/qwen3.5-35B-A3B.sh,
            # `--moe-router-dtype fp32`); in bf16 near-equal logits of 128-256 experts can swap
            # the top-k (megatron-core warns of it)
            moe_router_dtype="fp32",
        )
    if arch.hybrid:
        kwargs.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[int(arch.is_linear(i)) for i in range(arch.num_layers)],
            linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
            linear_key_head_dim=arch.linear_key_head_dim,
            linear_value_head_dim=arch.linear_value_head_dim,
            linear_num_key_heads=arch.linear_num_key_heads,
            linear_num_value_heads=arch.linear_num_value_heads,
        )
    if arch.attention_output_gate:
        kwargs["attention_output_gate"] = True
    if arch.zero_centered_norms:
        kwargs["layernorm_zero_centered_gamma"] = True
    if arch.shared_expert_intermediate_size:
        kwargs.update(
            moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,  # sigmoid(x @ gate) scales the shared expert's output
        )
    first = first_stage_layers(arch, parallel.pp)
    if first is not None and "num_layers_in_first_pipeline_stage" not in overrides:
        kwargs["num_layers_in_first_pipeline_stage"] = first
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    if arch.hybrid and parallel.cp > 1:
        # megatron-core 0.16.1 refuses CP with its gated delta net, whose forward has none;
        # PackedGatedDeltaNet's gathers the row over CP (vlm_models.megatron.context_parallel)
        config.context_parallel_size = parallel.cp
    logger.debug("TransformerConfig for %s: %s", type(hf_config).__name__, config)
    return config
