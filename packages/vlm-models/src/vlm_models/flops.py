"""Parameter counts and FLOPs per token, for MFU.

FLOPs follow the usual convention (PaLM appendix B, torchtitan): a matmul with ``N`` weights
costs ``2 N`` FLOPs per token forward, attention scores and values cost ``4 * heads * head_dim *
context`` per token and layer (full context, no causal discount), and a training step costs 3x
the forward. Norms, activations and rotary embeddings are left out. Counts are analytical from
the config (no model needed), so they work for full-size shapes on any machine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts: ``total``, ``trainable``, ``vision``, ``language`` and ``embedding``
    (input embedding plus an untied ``lm_head``); tied weights counted once."""
    from vlm_models.build import vision_tower

    params = dict(model.named_parameters())  # deduplicates tied weights
    try:
        vision_ids = {id(p) for p in vision_tower(model).parameters()}
    except AttributeError:
        vision_ids = set()
    embedding = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings()
    embedding_ids = {id(embedding)} | ({id(out_emb.weight)} if out_emb is not None else set())
    total = sum(p.numel() for p in params.values())
    vision = sum(p.numel() for p in params.values() if id(p) in vision_ids)
    return {
        "total": total,
        "trainable": sum(p.numel() for p in params.values() if p.requires_grad),
        "vision": vision,
        "language": total - vision,
        "embedding": sum(p.numel() for p in params.values() if id(p) in embedding_ids),
    }


def _text(config: PretrainedConfig) -> PretrainedConfig:
    return getattr(config, "text_config", config)


def _layer_types(tc: PretrainedConfig) -> list[str]:
    return list(getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers)


def _is_moe_layer(tc: PretrainedConfig, layer: int) -> bool:
    if not getattr(tc, "num_experts", 0):
        return False
    step = getattr(tc, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(tc, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


def lm_matmul_params(config: PretrainedConfig, *, active: bool = True) -> int:
    """Weights of the language model's matmuls (embedding lookup excluded, ``lm_head`` included).

    With ``active`` only the routed experts a token uses count (``num_experts_per_tok``).
    """
    tc = _text(config)
    h, nh, hd = tc.hidden_size, tc.num_attention_heads, getattr(tc, "head_dim", None)
    hd = hd or h // nh
    nkv = tc.num_key_value_heads
    gated_q = 2 if tc.model_type.startswith("qwen3_5") else 1  # Qwen3.5 q_proj also emits a gate
    full_attn = h * nh * hd * gated_q + 2 * h * nkv * hd + nh * hd * h
    total = 0
    for layer, kind in enumerate(_layer_types(tc)):
        if kind == "linear_attention":
            key_dim = tc.linear_num_key_heads * tc.linear_key_head_dim
            value_dim = tc.linear_num_value_heads * tc.linear_value_head_dim
            nv = tc.linear_num_value_heads
            total += h * (2 * key_dim + value_dim) + h * value_dim + 2 * h * nv + value_dim * h
            total += tc.linear_conv_kernel_dim * (2 * key_dim + value_dim)  # depthwise conv
        else:
            total += full_attn
        if _is_moe_layer(tc, layer):
            experts = tc.num_experts_per_tok if active else tc.num_experts
            total += h * tc.num_experts + experts * 3 * h * tc.moe_intermediate_size
            shared = getattr(tc, "shared_expert_intermediate_size", 0) or 0
            total += 3 * h * shared + (h if shared else 0)
        else:
            total += 3 * h * tc.intermediate_size
    return total + h * tc.vocab_size  # lm_head (tied or not, it is a matmul)


def vision_params(config: PretrainedConfig) -> int:
    """Parameters of the vision tower: patch and position embeddings, blocks, the merger and
    the deepstack mergers (LayerNorms and biases included)."""
    vc = config.vision_config
    d, inter = vc.hidden_size, vc.intermediate_size
    merged = d * vc.spatial_merge_size**2
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    block = (3 * d * d + 3 * d) + (d * d + d) + (2 * d * inter + inter + d) + 2 * 2 * d
    fcs = merged * merged + merged + merged * vc.out_hidden_size + vc.out_hidden_size
    deepstack = len(getattr(vc, "deepstack_visual_indexes", None) or [])
    mergers = (2 * d + fcs) + deepstack * (2 * merged + fcs)  # norm over d, or over merged
    return patch_dim * d + d + vc.num_position_embeddings * d + vc.depth * block + mergers


def parameter_counts(config: PretrainedConfig) -> dict[str, int]:
    """``language``, ``vision`` and ``total`` parameters from the config alone (all experts;
    an untied ``lm_head`` counted beside the embedding), for memory estimates of shapes too
    big to build. Exact for dense Qwen3-VL (tests compare with built models)."""
    tc = _text(config)
    hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    norms = tc.num_hidden_layers * (2 * tc.hidden_size + 2 * hd) + tc.hidden_size
    tied = getattr(tc, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))
    embedding = 0 if tied else tc.vocab_size * tc.hidden_size  # the lm_head matmul is counted
    language = lm_matmul_params(config, active=False) + embedding + norms
    vision = vision_params(config) if hasattr(config, "vision_config") else 0
    return {"language": language, "vision": vision, "total": language + vision}


def _attention_flops_per_token(config: PretrainedConfig, seq_len: int) -> int:
    tc = _text(config)
    hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    flops = 0
    for kind in _layer_types(tc):
        if kind == "linear_attention":  # recurrent state update + readout, O(1) in seq_len
            nv = tc.linear_num_value_heads
            flops += 4 * nv * tc.linear_key_head_dim * tc.linear_value_head_dim
        else:
            flops += 4 * tc.num_attention_heads * hd * seq_len
    return flops


def flops_per_token(config: PretrainedConfig, seq_len: int, *, training: bool = True) -> int:
    """Language-model FLOPs per token at context ``seq_len`` (training: forward + backward)."""
    forward = 2 * lm_matmul_params(config, active=True) + _attention_flops_per_token(
        config, seq_len
    )
    return forward * (3 if training else 1)


def vision_matmul_params_per_patch(config: PretrainedConfig) -> float:
    """Vision-tower matmul weights applied per input patch (mergers amortised over the
    ``merge**2`` patches they fuse)."""
    vc = config.vision_config
    d, merge = vc.hidden_size, vc.spatial_merge_size**2
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    blocks = vc.depth * (4 * d * d + 2 * d * vc.intermediate_size)
    merged = d * merge
    n_mergers = 1 + len(getattr(vc, "deepstack_visual_indexes", None) or [])
    mergers = n_mergers * (merged * merged + merged * vc.out_hidden_size) / merge
    return patch_dim * d + blocks + mergers


def vision_flops(
    config: PretrainedConfig,
    image_grid_thw: Tensor | Iterable[Iterable[int]],
    *,
    training: bool = True,
) -> float:
    """Vision-tower FLOPs for a set of images (``[n, 3]`` grids of (t, h, w) patches).

    Attention is bidirectional within each frame (``h * w`` patches; an image is one frame),
    as the tower's ``cu_seqlens`` split it. Pass ``training=False`` when the tower is frozen (no
    backward runs through it).
    """
    vc = config.vision_config
    per_patch = 2 * vision_matmul_params_per_patch(config)
    total = 0.0
    for t, h, w in torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist():
        total += t * h * w * (per_patch + 4 * vc.hidden_size * vc.depth * h * w)
    return total * (3 if training else 1)
