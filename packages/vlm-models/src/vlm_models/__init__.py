"""vlm_models: Qwen3-VL / Qwen3.5 through transformers, with a fast vision path.

Builders (:func:`build_model`, :func:`tiny_config`); the model files
(``vlm_models.qwen3_vl.model``, ``vlm_models.qwen3_5.model``: subclasses of transformers'
classes with our forwards, which ``build_model`` selects through :func:`select_classes`);
packed M-RoPE position ids, parameter and FLOP counts, weight sync. Megatron modules live in
``vlm_models.megatron`` and are not imported here.

`ModelConfig` (and `ModelSourceError`) import at once; every other name loads its module on first
use, since those import transformers (seconds) and a launcher parses its flags without them.
"""

import importlib
from typing import Any

from vlm_models.config import SUPPORTED_MODELS, TINY_MODEL, ModelConfig, ModelSourceError

_EXPORTS: dict[str, tuple[str, ...]] = {
    "build": (
        "build_model",
        "check_attn_implementation",
        "resolve_config",
        "set_vision_trainable",
        "vision_tower",
    ),
    "flops": (
        "count_parameters",
        "flops_per_token",
        "lm_matmul_params",
        "parameter_counts",
        "vision_flops",
        "vision_matmul_params_per_patch",
        "vision_params",
    ),
    "classes": (
        "OPTIONS",
        "Swap",
        "select_classes",
    ),
    "hub": (
        "has_weights",
        "resolve_model_source",
    ),
    "sources": (
        "model_config",
        "model_shape",
        "model_source",
        "processor_source",
        "resolve_load",
        "resolve_model",
        "shape_of",
    ),
    "linear_attention": (
        "has_linear_attention",
        "linear_attention_packs",
    ),
    "packing": (
        "cu_seqlens_from_lengths",
        "mm_token_types",
        "packed_inputs",
        "packed_position_ids",
        "sample_position_ids",
        "supports_packed_forward",
        "text_position_ids",
    ),
    "patch_embed": (
        "Conv3dPatchEmbed",
        "LinearPatchEmbed",
    ),
    "presets": (
        "PRESETS",
        "SHAPE_PRESETS",
        "TINY_PRESETS",
        "preset_config",
        "tiny_config",
    ),
    "sync_free": (
        "HostSyncRecorder",
        "PlaceholderMask",
    ),
    "varlen": (
        "HAS_FLASH_VARLEN",
        "flash_varlen",
        "flash_varlen_supported",
    ),
    "vision_inputs": ("VisionInputs",),
    "weights": (
        "hf_named_tensors",
        "load_named_tensors",
        "to_checkpoint_layout",
    ),
}
_LAZY = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name of `_EXPORTS`, imported once; afterwards a plain attribute."""
    module = _LAZY.get(name)
    if module is None:
        if name in globals():  # loaded by another thread meanwhile
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    _LAZY.pop(name, None)
    return value


__all__ = ["SUPPORTED_MODELS", "TINY_MODEL", "ModelConfig", "ModelSourceError", *_LAZY]
