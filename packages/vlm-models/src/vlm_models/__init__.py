"""vlm_models: Qwen3-VL / Qwen3.5 through transformers, with a fast vision path.

Builders (:func:`build_model`, :func:`tiny_config`), the GEMM patch embedding, packed M-RoPE
position ids and utilities for MFU and weight sync. Megatron modules live in
``vlm_models.megatron`` and are not imported here.
"""

from vlm_models.build import (
    build_model,
    check_attn_implementation,
    resolve_config,
    set_vision_trainable,
    vision_tower,
)
from vlm_models.patch_embed import Conv3dPatchEmbed, LinearPatchEmbed, set_fast_patch_embed
from vlm_models.presets import PRESETS, SHAPE_PRESETS, TINY_PRESETS, preset_config, tiny_config

__all__ = [
    "PRESETS",
    "SHAPE_PRESETS",
    "TINY_PRESETS",
    "Conv3dPatchEmbed",
    "LinearPatchEmbed",
    "build_model",
    "check_attn_implementation",
    "preset_config",
    "resolve_config",
    "set_fast_patch_embed",
    "set_vision_trainable",
    "tiny_config",
    "vision_tower",
]
