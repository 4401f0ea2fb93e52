"""Megatron-Core ``TransformerConfig`` for a Qwen3-VL language model, from the HF config."""

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
    """How the language model is split. ``sp`` (sequence parallel) needs ``tp > 1``."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep) < 1:
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
    extra: dict[str, Any] = field(default_factory=dict)


def text_arch(hf_config: PretrainedConfig) -> TextArch:
    """Read a Qwen3-VL (dense or MoE) ``*Config`` into a :class:`TextArch`."""
    text = getattr(hf_config, "text_config", hf_config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not rope.get("mrope_interleaved", True):
        raise NotImplementedError("only Qwen3-VL's interleaved M-RoPE is supported")
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {rope.get('rope_type')!r} is not supported")
    if getattr(text, "layer_types", None) and set(text.layer_types) != {"full_attention"}:
        raise NotImplementedError("hybrid (linear-attention) layers are not supported yet")
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
        intermediate_size=text.intermediate_size,
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
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,
        )
    first = first_stage_layers(arch, parallel.pp)
    if first is not None and "num_layers_in_first_pipeline_stage" not in overrides:
        kwargs["num_layers_in_first_pipeline_stage"] = first
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    logger.debug("TransformerConfig for %s: %s", type(hf_config).__name__, config)
    return config
