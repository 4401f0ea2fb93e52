"""Qwen3-VL and Qwen3.5 on Megatron-Core: native language model + HF vision tower, and weight
conversion (Qwen3.5's gated-delta-net layers: :mod:`vlm_models.megatron.gated_delta_net`).

Needs megatron-core (``uv sync --extra megatron``, or ``pip install megatron-core==0.16.1``);
``import vlm_models`` alone never imports it. Transformer Engine is optional (``use_te=True``).

    from vlm_models.megatron import (Parallelism, initialize_model_parallel,
                                     build_megatron_model, load_hf_weights, rope_position_ids)
    initialize_model_parallel(Parallelism(tp=2))
    model = build_megatron_model(hf_config)
    load_hf_weights(model, hf_state_dict)
    logits = model(input_ids, rope_position_ids(input_ids, hf_config, image_grid_thw=grid,
                   mm_token_type_ids=mm), pixel_values=pv, image_grid_thw=grid)
"""

try:
    import megatron.core  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vlm_models.megatron needs megatron-core: run `uv sync --extra megatron` (or "
        "`pip install megatron-core==0.16.1`)"
    ) from err

from vlm_models.megatron._cpu_compat import apply as apply_cpu_compat
from vlm_models.megatron.checkpoint import (
    SafetensorsReader,
    hf_to_megatron_checkpoint,
    load_megatron_checkpoint,
    megatron_to_hf_checkpoint,
)
from vlm_models.megatron.compiling import (
    compile_decoder_layers,
    compile_vision_blocks,
    compiles_by_default,
)
from vlm_models.megatron.config import (
    Parallelism,
    TextArch,
    first_stage_layers,
    text_arch,
    transformer_config,
)
from vlm_models.megatron.convert import (
    fuse_qkv,
    hf_state_dict_to_megatron,
    hf_to_megatron_stage,
    megatron_shards_to_hf,
    megatron_to_hf_stage,
    split_qkv,
)
from vlm_models.megatron.file_layout import (
    from_file_layout,
    to_checkpoint_tensors,
    to_file_layout,
)
from vlm_models.megatron.gated_delta_net import (
    PackedGatedDeltaNet,
    fla_available,
    gated_delta_net_spec,
    packs_samples,
)
from vlm_models.megatron.layers import (
    DeepstackTransformerLayer,
    GatedSelfAttention,
    RMSNorm,
    SDPACoreAttention,
    block_spec,
    layer_spec,
)
from vlm_models.megatron.model import (
    MRoPEGPTModel,
    Qwen3VLMegatronModel,
    build_megatron_model,
    rope_position_ids,
)
from vlm_models.megatron.name_map import ParamMap, StageLayout, stage_layouts, stage_param_maps
from vlm_models.megatron.parallel import destroy_model_parallel, initialize_model_parallel
from vlm_models.megatron.rope import InterleavedMRoPE, interleaved_mrope_angles
from vlm_models.megatron.weights import iter_hf_weights, load_hf_weights, param_maps, stage_layout

__all__ = [
    "DeepstackTransformerLayer",
    "GatedSelfAttention",
    "InterleavedMRoPE",
    "MRoPEGPTModel",
    "PackedGatedDeltaNet",
    "Parallelism",
    "ParamMap",
    "Qwen3VLMegatronModel",
    "RMSNorm",
    "SDPACoreAttention",
    "SafetensorsReader",
    "StageLayout",
    "TextArch",
    "apply_cpu_compat",
    "block_spec",
    "build_megatron_model",
    "compile_decoder_layers",
    "compile_vision_blocks",
    "compiles_by_default",
    "destroy_model_parallel",
    "first_stage_layers",
    "fla_available",
    "from_file_layout",
    "fuse_qkv",
    "gated_delta_net_spec",
    "hf_state_dict_to_megatron",
    "hf_to_megatron_checkpoint",
    "hf_to_megatron_stage",
    "initialize_model_parallel",
    "interleaved_mrope_angles",
    "iter_hf_weights",
    "layer_spec",
    "load_hf_weights",
    "load_megatron_checkpoint",
    "megatron_shards_to_hf",
    "megatron_to_hf_checkpoint",
    "megatron_to_hf_stage",
    "packs_samples",
    "param_maps",
    "rope_position_ids",
    "split_qkv",
    "stage_layout",
    "stage_layouts",
    "stage_param_maps",
    "text_arch",
    "to_checkpoint_tensors",
    "to_file_layout",
    "transformer_config",
]
