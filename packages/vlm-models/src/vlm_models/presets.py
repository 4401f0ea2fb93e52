"""Named model shapes built in code, so benchmarks and tests need no files.

Two kinds of preset:

* shape presets (``qwen3-vl-2b``, ``qwen3-vl-4b``, ``qwen3-vl-8b``, ``qwen3-vl-30b-a3b``,
  ``qwen3.5-35b-a3b``): the published architectures, for random-init benchmarks at full size
  (or cut to a few layers) and memory estimates before a download;
* tiny presets (``qwen3-vl-tiny``, ``qwen3-vl-moe-tiny``, ``qwen3.5-tiny``,
  ``qwen3.5-moe-tiny``): the same
  architecture features (deepstack, interleaved M-RoPE with ``mrope_section``, GQA, tied or
  untied embeddings, MoE routing, hybrid linear attention) at a size that runs on a CPU in
  seconds. The patch geometry (patch 16, temporal 2, merge 2, 3 channels) and special token ids
  are the real ones, so real processor outputs feed the tiny models unchanged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from transformers import PretrainedConfig, Qwen3VLConfig, Qwen3VLMoeConfig

logger = logging.getLogger(__name__)

# Token ids shared by every Qwen3-VL size (the tokenizer is the same).
_QWEN3_VL_TOKENS = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
_QWEN3_VL_TEXT_COMMON = dict(
    vocab_size=151936,
    hidden_act="silu",
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_interleaved": True,
        "mrope_section": [24, 20, 20],
    },
)
# Vision geometry that the real processor produces: keep it in every preset, tiny included.
_PATCH_GEOMETRY = dict(in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2)
_VISION_SMALL = dict(  # Qwen3-VL 2B / 4B vision tower
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    deepstack_visual_indexes=[5, 11, 17],
)
_VISION_LARGE = dict(  # Qwen3-VL 8B / 30B-A3B vision tower
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    deepstack_visual_indexes=[8, 16, 24],
)


def _vision(base: dict[str, Any], out_hidden_size: int) -> dict[str, Any]:
    return dict(
        **base,
        **_PATCH_GEOMETRY,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304,
        out_hidden_size=out_hidden_size,
        initializer_range=0.02,
    )


def _dense(text: dict[str, Any], vision: dict[str, Any], tie: bool) -> Qwen3VLConfig:
    text_config = dict(_QWEN3_VL_TEXT_COMMON, **text, tie_word_embeddings=tie)
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=_vision(vision, text["hidden_size"]),
        tie_word_embeddings=tie,
        **_QWEN3_VL_TOKENS,
    )


def qwen3_vl_2b() -> Qwen3VLConfig:
    """Qwen3-VL-2B: text 2048 x 28 layers, 16 heads / 8 KV, tied embeddings; 4B's vision."""
    text = dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
    )
    return _dense(text, _VISION_SMALL, tie=True)


def qwen3_vl_4b() -> Qwen3VLConfig:
    """Qwen3-VL-4B (as ../shared/models/Qwen3-VL-4B-Instruct/config.json)."""
    text = dict(
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
    )
    return _dense(text, _VISION_SMALL, tie=True)


def qwen3_vl_8b() -> Qwen3VLConfig:
    """Qwen3-VL-8B (as ../shared/models/reference-configs/qwen3-vl-8b-architecture.json)."""
    text = dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
    )
    return _dense(text, _VISION_LARGE, tie=False)


def qwen3_vl_30b_a3b() -> Qwen3VLMoeConfig:
    """Qwen3-VL-30B-A3B: 48 MoE layers, 128 experts, 8 routed per token, untied embeddings."""
    text = dict(
        _QWEN3_VL_TEXT_COMMON,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    return Qwen3VLMoeConfig(
        text_config=text,
        vision_config=_vision(_VISION_LARGE, 2048),
        tie_word_embeddings=False,
        **_QWEN3_VL_TOKENS,
    )


# Tiny shapes: every architectural feature kept, sizes cut. head_dim 32 -> 16 rotary pairs,
# split [6, 5, 5] over (t, h, w) and interleaved like the real [24, 20, 20].
_TINY_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=4,  # > 3 so all three deepstack features land in distinct layers
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    head_dim=32,
    intermediate_size=128,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_interleaved": True,
        "mrope_section": [6, 5, 5],
    },
)
_TINY_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    deepstack_visual_indexes=[0, 1, 2],  # three deepstack mergers, as the real models
)


def qwen3_vl_tiny() -> Qwen3VLConfig:
    """Tiny dense Qwen3-VL: deepstack, interleaved M-RoPE, GQA, tied embeddings."""
    return _dense(_TINY_TEXT, _TINY_VISION, tie=True)


def qwen3_vl_moe_tiny() -> Qwen3VLMoeConfig:
    """Tiny Qwen3-VL MoE: 8 experts, top-2 routing, untied embeddings (as 30B-A3B)."""
    text = dict(
        _QWEN3_VL_TEXT_COMMON,
        **_TINY_TEXT,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    text["rope_parameters"] = _TINY_TEXT["rope_parameters"]
    return Qwen3VLMoeConfig(
        text_config=text,
        vision_config=_vision(_TINY_VISION, _TINY_TEXT["hidden_size"]),
        tie_word_embeddings=False,
        **_QWEN3_VL_TOKENS,
    )


# Tiny Qwen3.5 text model: 3 gated-delta-net layers, then one gated full-attention layer.
_TINY_QWEN3_5_TEXT = dict(
    vocab_size=248320,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=128,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,  # 16 rotary dims -> 8 pairs
        "mrope_interleaved": True,
        "mrope_section": [3, 3, 2],
    },
    tie_word_embeddings=False,
)
_TINY_QWEN3_5_VISION = dict(
    **_PATCH_GEOMETRY,
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    num_position_embeddings=2304,
    hidden_act="gelu_pytorch_tanh",
)


def qwen3_5_tiny() -> PretrainedConfig:
    """Tiny Qwen3.5: hybrid gated-delta-net / full attention (3:1), partial M-RoPE, no deepstack."""
    from transformers import Qwen3_5Config  # absent from older transformers

    return Qwen3_5Config(
        text_config=copy.deepcopy(_TINY_QWEN3_5_TEXT),
        vision_config=dict(_TINY_QWEN3_5_VISION),
        tie_word_embeddings=False,
    )


def qwen3_5_moe_tiny() -> PretrainedConfig:
    """Tiny Qwen3.5 MoE (35B-A3B's layout): the hybrid layers of ``qwen3.5-tiny`` with 8 routed
    experts (top-2) and a shared expert in every layer."""
    from transformers import Qwen3_5MoeConfig  # absent from older transformers

    text = copy.deepcopy(_TINY_QWEN3_5_TEXT)
    del text["intermediate_size"]
    text.update(
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return Qwen3_5MoeConfig(
        text_config=text,
        vision_config=dict(_TINY_QWEN3_5_VISION),
        tie_word_embeddings=False,
    )


def qwen3_5_35b_a3b() -> PretrainedConfig:
    """Qwen3.5-35B-A3B (the slime recipe's model): 40 layers, three gated-delta-net layers then
    one gated full-attention layer, 256 routed experts (top-8) and a gated shared expert in
    every layer, partial M-RoPE over a quarter of each 256-wide head, untied embeddings, the
    27-block vision tower; its MTP head is not part of the config's model."""
    from transformers import Qwen3_5MoeConfig  # absent from older transformers

    text = dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,  # 64 rotary dims -> 32 pairs
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        tie_word_embeddings=False,
    )
    vision = dict(
        _PATCH_GEOMETRY,
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=2048,
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    )
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _has_qwen3_5() -> bool:
    import transformers

    return hasattr(transformers, "Qwen3_5Config") and hasattr(transformers, "Qwen3_5MoeConfig")


SHAPE_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-vl-2b": qwen3_vl_2b,
    "qwen3-vl-4b": qwen3_vl_4b,
    "qwen3-vl-8b": qwen3_vl_8b,
    "qwen3-vl-30b-a3b": qwen3_vl_30b_a3b,
}
TINY_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-vl-tiny": qwen3_vl_tiny,
    "qwen3-vl-moe-tiny": qwen3_vl_moe_tiny,
}
if _has_qwen3_5():
    SHAPE_PRESETS["qwen3.5-35b-a3b"] = qwen3_5_35b_a3b
    TINY_PRESETS["qwen3.5-tiny"] = qwen3_5_tiny
    TINY_PRESETS["qwen3.5-moe-tiny"] = qwen3_5_moe_tiny

PRESETS: dict[str, Callable[[], PretrainedConfig]] = {**SHAPE_PRESETS, **TINY_PRESETS}


def apply_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    """Set ``overrides`` on ``config`` in place and return it.

    A key is set on the top-level config when it has that attribute (``image_token_id``,
    ``tie_word_embeddings``), otherwise on ``text_config`` (``vocab_size``, ``num_hidden_layers``).
    ``vision_config.depth`` style keys address a sub-config explicitly.
    """
    for key, value in overrides.items():
        if "." in key:
            sub, attr = key.split(".", 1)
            target = getattr(config, sub)
        elif key not in ("vocab_size",) and hasattr(config, key):
            target, attr = config, key
        elif hasattr(config, "text_config") and hasattr(config.text_config, key):
            target, attr = config.text_config, key
        else:
            raise ValueError(f"config override {key!r}: no such field on {type(config).__name__}")
        setattr(target, attr, value)
        types = getattr(target, "layer_types", None)
        if attr == "num_hidden_layers" and types and len(types) != value:
            # a cut (or grown) Qwen3.5 keeps its pattern (three linear-attention layers, then
            # a full one): transformers refuses a config whose layer_types miss the count
            target.layer_types = [types[i % len(types)] for i in range(value)]
        if attr == "tie_word_embeddings" and target is config and hasattr(config, "text_config"):
            config.text_config.tie_word_embeddings = value
    return config


def preset_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The config of a named preset (shape or tiny), with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    config = PRESETS[name]()
    return apply_overrides(copy.deepcopy(config), overrides)


def tiny_config(preset: str = "qwen3-vl-tiny", **overrides: Any) -> PretrainedConfig:
    """A tiny config built in code (no files) keeping the architecture's features.

    ``overrides`` adjust it, e.g. ``vocab_size=len(tokenizer)`` or ``image_token_id=...`` to
    match a small test tokenizer.
    """
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; known: {', '.join(TINY_PRESETS)}")
    return preset_config(preset, **overrides)
