"""vlm_models: Qwen3-VL / Qwen3.5 through transformers, with a fast vision path.

Builders (:func:`build_model`, :func:`tiny_config`), the GEMM patch embedding, packed M-RoPE
position ids, the packed :class:`MicroBatch` both trainers use, packed linear attention (state
reset at sample boundaries) and utilities for MFU and weight sync. Megatron modules live in ``vlm_models.megatron`` and are not imported here.
"""

from vlm_models.build import (
    build_model,
    check_attn_implementation,
    resolve_config,
    set_vision_trainable,
    vision_tower,
)
from vlm_models.flops import (
    count_parameters,
    flops_per_token,
    lm_matmul_params,
    parameter_counts,
    vision_flops,
    vision_matmul_params_per_patch,
    vision_params,
)
from vlm_models.hub import ModelSourceError, has_weights, resolve_model_source
from vlm_models.linear_attention import (
    has_linear_attention,
    linear_attention_packs,
    pack_linear_attention,
)
from vlm_models.microbatch import MicroBatch, PinnedStaging, build_micro_batch, dummy_image
from vlm_models.offload import HostCopies
from vlm_models.packing import (
    cu_seqlens_from_lengths,
    mm_token_types,
    packed_inputs,
    packed_position_ids,
    sample_position_ids,
    supports_packed_forward,
    text_position_ids,
)
from vlm_models.patch_embed import Conv3dPatchEmbed, LinearPatchEmbed, set_fast_patch_embed
from vlm_models.presets import PRESETS, SHAPE_PRESETS, TINY_PRESETS, preset_config, tiny_config
from vlm_models.sync_free import remove_host_syncs
from vlm_models.varlen import HAS_FLASH_VARLEN, flash_varlen, flash_varlen_supported
from vlm_models.vision_attention import fuse_vision_attention, replace_forwards
from vlm_models.vision_inputs import VisionInputs
from vlm_models.weights import (
    hf_named_tensors,
    iter_weight_buckets,
    load_named_tensors,
    to_checkpoint_layout,
)

__all__ = [
    "HAS_FLASH_VARLEN",
    "PRESETS",
    "SHAPE_PRESETS",
    "TINY_PRESETS",
    "Conv3dPatchEmbed",
    "HostCopies",
    "LinearPatchEmbed",
    "MicroBatch",
    "ModelSourceError",
    "PinnedStaging",
    "VisionInputs",
    "build_micro_batch",
    "build_model",
    "check_attn_implementation",
    "count_parameters",
    "cu_seqlens_from_lengths",
    "dummy_image",
    "flash_varlen",
    "flash_varlen_supported",
    "flops_per_token",
    "fuse_vision_attention",
    "has_linear_attention",
    "has_weights",
    "hf_named_tensors",
    "iter_weight_buckets",
    "linear_attention_packs",
    "lm_matmul_params",
    "load_named_tensors",
    "mm_token_types",
    "pack_linear_attention",
    "packed_inputs",
    "packed_position_ids",
    "parameter_counts",
    "preset_config",
    "remove_host_syncs",
    "replace_forwards",
    "resolve_config",
    "resolve_model_source",
    "sample_position_ids",
    "set_fast_patch_embed",
    "set_vision_trainable",
    "supports_packed_forward",
    "text_position_ids",
    "tiny_config",
    "to_checkpoint_layout",
    "vision_flops",
    "vision_matmul_params_per_patch",
    "vision_params",
    "vision_tower",
]
