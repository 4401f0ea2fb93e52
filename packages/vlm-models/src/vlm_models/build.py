"""Build Qwen3-VL / Qwen3.5 models through transformers, from weights or from a config alone."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig

from vlm_models.classes import select_classes
from vlm_models.hub import resolve_model_source
from vlm_models.linear_attention import use_float32_delta_rule
from vlm_models.presets import PRESETS, apply_overrides, preset_config

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# attention implementation -> (module that must import, install hint)
_ATTN_REQUIREMENTS = {
    "flash_attention_2": (
        "flash_attn",
        "flash-attn is not installed: `uv sync --extra gpu` (or "
        "`pip install flash-attn --no-build-isolation`) on a CUDA machine, or use 'sdpa'",
    ),
    "flash_attention_3": (
        "flash_attn_interface",
        "FlashAttention-3 is not installed: build `hopper/` of "
        "https://github.com/Dao-AILab/flash-attention on an H100/H200, or use 'sdpa'",
    ),
}


def check_attn_implementation(name: str) -> None:
    """Raise ImportError with an install hint when ``name`` needs a package that is missing."""
    requirement = _ATTN_REQUIREMENTS.get(name)
    if requirement and importlib.util.find_spec(requirement[0]) is None:
        raise ImportError(requirement[1])


def resolve_config(source: str | Path | PretrainedConfig, **overrides: Any) -> PretrainedConfig:
    """The config for ``source`` (preset name, local folder, hub id or config), overrides applied."""
    if isinstance(source, PretrainedConfig):
        return apply_overrides(copy.deepcopy(source), overrides)
    if isinstance(source, str) and source in PRESETS:
        return preset_config(source, **overrides)
    return apply_overrides(AutoConfig.from_pretrained(str(source)), overrides)


def _has_local_weights(path: Path) -> bool:
    return any(p.name.endswith(_WEIGHT_SUFFIXES) for p in path.iterdir())


#: safetensors' names of the floating dtypes (the header's ``dtype`` field)
_SAFETENSORS_FLOATS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def stored_float_dtypes(folder: str | Path) -> set[torch.dtype] | None:
    """The dtypes the checkpoint in ``folder`` stores its floating tensors in, read from the
    safetensors headers alone (nothing is loaded); None where that cannot be known (no
    safetensors files, or weights in another format beside them)."""
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    others = [f for f in folder.iterdir() if f.name.endswith(_WEIGHT_SUFFIXES)]
    if not files or len(others) != len(files):
        return None
    out: set[torch.dtype] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                dtype = _SAFETENSORS_FLOATS.get(handle.get_slice(name).get_dtype())
                if dtype is not None:
                    out.add(dtype)
    return out


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder (``model.model.visual`` for Qwen3-VL and Qwen3.5)."""
    inner = getattr(model, "model", model)
    visual = getattr(inner, "visual", None)
    if visual is None:
        raise AttributeError(f"{type(model).__name__} has no vision tower at .model.visual")
    return visual


def build_model(
    source: str | Path | PretrainedConfig,
    *,
    dtype: torch.dtype = torch.float32,
    narrow_dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    vision_attn_implementation: str | None = None,
    fast_patch_embed: bool = True,
    fused_vision_attention: bool = False,
    fused_rms_norm: bool = False,
    sync_free: bool = False,
    packed_linear_attention: bool = False,
    routing_replay: bool = False,
    gradient_checkpointing: bool = False,
    freeze_vision: bool = False,
    device: str | torch.device | None = None,
    **config_overrides: Any,
) -> nn.Module:
    """Build a ``*ForConditionalGeneration`` vision-language model.

    ``source`` is a preset name (``"qwen3-vl-4b"``, ``"qwen3-vl-tiny"``...; random init), a
    config object (random init), a local folder (weights loaded when it holds any, otherwise
    random init from its ``config.json``, with a warning) or a hub id (downloaded once through
    :func:`~vlm_models.hub.resolve_model_source`; a missing folder or an unreachable id raises
    :class:`~vlm_models.hub.ModelSourceError`).

    ``attn_implementation`` applies to the language model, ``vision_attn_implementation``
    (default: the same) to the vision tower: "sdpa", "eager", "flash_attention_2",
    "flash_attention_3".

    Which of our classes run (the model files' tables, :mod:`vlm_models.qwen3_vl.model` and
    :mod:`vlm_models.qwen3_5.model`; same parameters and names as transformers'):
    ``fast_patch_embed``, the GEMM patch embedding; ``fused_vision_attention``, bf16 rotary and
    one varlen kernel for all images; ``fused_rms_norm``, ``F.rms_norm`` where the formula
    matches; ``sync_free``, the image merge and DeepStack without host syncs (the caller checks
    placeholder counts on the host); ``packed_linear_attention``, Qwen3.5's gated delta net
    resetting its state at the boundaries given as ``packed_seq_info``; ``routing_replay``,
    MoE routers that route to the expert ids :mod:`vlm_models.routing_replay` sets.
    ``config_overrides`` are set on the config first (see :func:`~vlm_models.presets.apply_overrides`).

    ``narrow_dtype``: load in this dtype instead of ``dtype`` when the checkpoint stores every
    floating tensor in it, so nothing is rounded. A trainer that keeps its own float32 masters
    of a bf16 checkpoint gets the same values without first widening the whole model on the
    host (for an 8B model 35 GB, and the slower part of its load).
    """
    vision_attn = vision_attn_implementation or attn_implementation
    for name in {attn_implementation, vision_attn}:
        check_attn_implementation(name)
    attn = {
        "": attn_implementation,
        "text_config": attn_implementation,
        "vision_config": vision_attn,
    }

    if not isinstance(source, PretrainedConfig) and str(source) not in PRESETS:
        source = resolve_model_source(str(source))  # a missing folder or hub id fails here
    config = resolve_config(source, **config_overrides)
    load_weights = False
    if not isinstance(source, PretrainedConfig) and not (
        isinstance(source, str) and source in PRESETS
    ):
        path = Path(source)
        load_weights = _has_local_weights(path) if path.is_dir() else True
        if path.is_dir() and not load_weights:
            logger.warning(
                "%s holds no weights: building %s with random init", path, config.model_type
            )

    if load_weights and narrow_dtype is not None and narrow_dtype != dtype:
        stored = stored_float_dtypes(source) if Path(source).is_dir() else None
        if stored == {narrow_dtype}:
            logger.info("%s: loaded as stored, in %s (nothing to round)", source, narrow_dtype)
            dtype = narrow_dtype
    if load_weights:
        model = AutoModelForImageTextToText.from_pretrained(
            str(source), config=config, dtype=dtype, attn_implementation=attn
        )
    else:
        # random init where the model will live: billions of parameters take minutes on a CPU
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = AutoModelForImageTextToText.from_config(
                config, dtype=dtype, attn_implementation=attn
            )
    logger.info(
        "built %s (%s, text attn %s, vision attn %s, %.1fM params)",
        type(model).__name__,
        "pretrained" if load_weights else "random init",
        attn_implementation,
        vision_attn,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )

    select_classes(
        model,
        fast_patch_embed=fast_patch_embed,
        fused_vision_attention=fused_vision_attention,
        fused_rms_norm=fused_rms_norm,
        sync_free=sync_free,
        packed_linear_attention=packed_linear_attention,
        routing_replay=routing_replay,
    )
    use_float32_delta_rule(model)  # Qwen3.5: the engine's and the trainers' rule alike
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if freeze_vision:
        set_vision_trainable(model, False)
    if device is not None:
        model.to(device)
    return model


def set_vision_trainable(model: nn.Module, trainable: bool) -> None:
    """Freeze (``False``) or unfreeze the whole vision tower, mergers and deepstack mergers included."""
    for p in vision_tower(model).parameters():
        p.requires_grad_(trainable)
