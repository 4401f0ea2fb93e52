"""``torch.compile`` for the Megatron model's decoder layers and its HF vision blocks.

Without Transformer Engine every decoder layer runs megatron-core's local modules eagerly: each
RMSNorm, rotary half-rotation, SwiGLU and residual add is its own kernel (plus its backward),
and on the H200 those elementwise passes cost more device time than the GEMMs they surround.
Compiling each layer (as the FSDP trainer does with its HF layers) fuses them. The layers
share one compiled function with dynamic shapes (micro-batches vary in length); modules,
names and parameters stay as they are for checkpoints and weight sync. The vision tower is
Transformers' own module, compiled block by block exactly as the FSDP trainer compiles it.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from vlm_models.megatron._upstream_fixes import quiet_default_tp_group

logger = logging.getLogger(__name__)


def compile_decoder_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer of ``model`` (a :class:`Qwen3VLMegatronModel` stage) in
    place; returns how many. ``backend="aot_eager"`` traces the same graphs without generating
    kernels (CPU tests)."""
    quiet_default_tp_group()  # else each layer's graph breaks at a warnings.warn
    decoder = getattr(model.language_model, "decoder", None)
    layers = list(decoder.layers) if decoder is not None else []
    # one compiled function for all layers: the layer is an argument, so its parameters are
    # graph inputs and the same graph serves every layer (no recompile per layer)
    compiled = torch.compile(TransformerLayer.forward, dynamic=True, backend=backend)
    for layer in layers:
        layer.layer_forward = compiled
    logger.info("compiled %d decoder layers", len(layers))
    return len(layers)


def compile_vision_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each block of ``model.visual`` (the HF vision tower; absent on later pipeline
    stages) in place, the units the tower declares in ``_no_split_modules``; returns how many.
    Eager, each block's LayerNorms, GELU MLP, rotary and residuals are separate kernels, forward
    and backward: the FSDP actor compiles the same blocks."""
    visual = getattr(model, "visual", None)
    if visual is None:
        return 0
    names = set(getattr(visual, "_no_split_modules", None) or ())
    blocks = [m for m in visual.modules() if type(m).__name__ in names]
    for block in blocks:
        block.compile(dynamic=True, backend=backend)
    logger.info("compiled %d vision blocks", len(blocks))
    return len(blocks)


def compiles_by_default(hf_config) -> bool:
    """Dense Qwen3-VL compiles on CUDA by default; MoE and linear-attention layers were never
    measured compiled, so they stay eager unless asked."""
    text = getattr(hf_config, "text_config", hf_config)
    moe = bool(getattr(text, "num_experts", None))
    linear = "linear_attention" in (getattr(text, "layer_types", None) or [])
    return not moe and not linear
