"""From a `ModelConfig` to what the trainers and engines load, settled in the launcher's
process before anything starts: hub names resolved to local folders (downloaded once), a run
folder standing for its `hf/`, the processor's source, and the model's config and shape where
they are known without a download (for the memory estimate)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlm_models.config import (
    HUB_NAMESPACE,
    SHAPE_OF_NAME,
    TINY_MODEL,
    ModelConfig,
    ModelSourceError,
)
from vlm_models.flops import parameter_counts
from vlm_models.hub import load_folder, resolve_model_source
from vlm_models.linear_attention import linear_state_bytes
from vlm_models.presets import PRESETS, SHAPE_PRESETS, TINY_PRESETS, preset_config, tiny_config


def resolve_load(path: str) -> str:
    """`--load`'s folder: a run folder (SFT or GRPO) stands for its exported `hf/`."""
    try:
        return str(load_folder(path))
    except ModelSourceError as err:
        raise ModelSourceError(f"--load {err}") from None


def resolve_model(model: ModelConfig, *, load: str | None = None) -> ModelConfig:
    """`model` with `model_name` (and a hub `tokenizer`) turned into local folders, or a
    preset name; one that cannot be resolved raises `ModelSourceError` naming the flag."""
    name, tokenizer = model.model_name, model.tokenizer
    try:
        if load is None and name != TINY_MODEL:
            name = resolve_model_source(name, hub_namespace=HUB_NAMESPACE, require_weights=True)
    except ModelSourceError as err:
        raise ModelSourceError(f"--model-name: {err}") from None
    try:
        if tokenizer not in (None, "tiny"):
            tokenizer = resolve_model_source(tokenizer, hub_namespace=HUB_NAMESPACE)
    except ModelSourceError as err:
        raise ModelSourceError(f"--tokenizer: {err}") from None
    if load is None and name in SHAPE_PRESETS and tokenizer is None:
        raise ModelSourceError(
            f"--model-name {name} is a shape preset (random weights) and has no processor: "
            "name one with --tokenizer FOLDER (any Qwen3-VL model folder)"
        )
    return dataclasses.replace(model, model_name=name, tokenizer=tokenizer)


def processor_source(model: ModelConfig, *, load: str | None = None) -> str:
    """Where the processor comes from: `tokenizer`, else the loaded folder's own processor,
    else the model's ('tiny' for the tiny model: built offline)."""
    if model.tokenizer is not None:
        return model.tokenizer
    if load:
        loaded = Path(resolve_load(load))
        if any(
            (loaded / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")
        ):
            return str(loaded)
    if model.model_name == TINY_MODEL:
        return "tiny"
    return model_source(model)


def model_source(
    model: ModelConfig, *, load: str | None = None, token_ids: Mapping[str, int] | None = None
) -> Any:
    """What `build_model` (and the trainer configs' `model`) should get: the `load` folder, a
    tiny config whose special ids are the processor's (`token_ids`, from
    `vlm_data.model_token_ids`), a shape preset's name, a folder or a hub id."""
    if load:
        return resolve_load(load)
    name = model.model_name
    if name in TINY_PRESETS:
        return tiny_config(name, **(token_ids or {}))
    if name in PRESETS:  # a shape preset: random weights, asked for by name
        return name
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    return name if "/" in name else f"{HUB_NAMESPACE}/{name}"


def model_config(model: ModelConfig, *, load: str | None = None) -> Any | None:
    """The model's HF config where it is known without downloading weights, else None."""
    from transformers import AutoConfig

    if load:
        return AutoConfig.from_pretrained(resolve_load(load))
    name = model.model_name
    if name in PRESETS:
        return preset_config(name)
    folder = Path(name).expanduser()
    for candidate in (folder / "hf", folder):
        if (candidate / "config.json").is_file():
            return AutoConfig.from_pretrained(candidate)
    base = name.rsplit("/", 1)[-1]
    shape = next((p for prefix, p in SHAPE_OF_NAME.items() if base.startswith(prefix)), None)
    return preset_config(shape) if shape in PRESETS else None


def model_shape(config: Any) -> dict[str, int]:
    """The numbers a memory estimate needs (`rl_runtime.ModelShape(**model_shape(config))`),
    from an HF config; for MoE, the intermediate size of a token's experts and the parameters
    of all routed experts (split by expert parallelism); for Qwen3.5, the gated-delta-net
    layers' states a rollout engine keeps per sequence (``linear_state_bytes``)."""
    tc = getattr(config, "text_config", config)
    inter, experts = getattr(tc, "intermediate_size", 0), 0  # Qwen3.5 MoE has none
    if getattr(tc, "num_experts", 0):
        shared = getattr(tc, "shared_expert_intermediate_size", 0) or 0
        inter = tc.num_experts_per_tok * tc.moe_intermediate_size + shared
        # gate, up and down projections of every routed expert of every layer
        experts = tc.num_hidden_layers * tc.num_experts * 3 * tc.hidden_size
        experts *= tc.moe_intermediate_size
    vc = getattr(config, "vision_config", None)
    counts = parameter_counts(config)
    return {
        "language_params": counts["language"],
        "vision_params": counts["vision"],
        "hidden_size": tc.hidden_size,
        "intermediate_size": inter,
        "num_layers": tc.num_hidden_layers,
        "vocab_size": tc.vocab_size,
        "vision_hidden_size": vc.hidden_size if vc else 0,
        "vision_intermediate_size": vc.intermediate_size if vc else 0,
        "vision_depth": vc.depth if vc else 0,
        "expert_params": experts,
        "kv_bytes_per_token": kv_bytes_per_token(tc),
        "state_bytes_per_sequence": linear_state_bytes(tc),
    }


def kv_bytes_per_token(text_config: Any) -> int:
    """bf16 keys and values one token leaves in a rollout engine's cache: every full-attention
    layer's (Qwen3.5's gated-delta-net layers keep a per-sequence state instead)."""
    types = getattr(text_config, "layer_types", None)
    layers = sum(t == "full_attention" for t in types) if types else text_config.num_hidden_layers
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads
    )
    return 2 * layers * heads * head_dim * 2


def shape_of(model: ModelConfig, *, load: str | None = None) -> dict[str, int] | None:
    """`model_shape` of the model's config where it is known without a download, else None."""
    config = model_config(model, load=load)
    return None if config is None else model_shape(config)


_PLACEHOLDER_IDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def check_token_ids(
    model: ModelConfig, token_ids: Mapping[str, int], *, load: str | None = None
) -> None:
    """Raise `ModelSourceError` where the model's config and the processor disagree on an image
    placeholder id, or the processor has more tokens than the model's vocabulary: every prompt
    would then fail the trainer's placeholder check (a tiny folder saved without the tiny
    processor's ids, a shape preset with the tiny tokenizer). Tiny presets take the processor's
    ids by construction; a config known only on the hub is not checked."""
    if load is None and model.model_name in TINY_PRESETS:
        return
    config = model_config(model, load=load)
    if config is None:
        return
    problems = [
        f"{key} {getattr(config, key)} (processor: {token_ids[key]})"
        for key in _PLACEHOLDER_IDS
        if key in token_ids and getattr(config, key, token_ids[key]) != token_ids[key]
    ]
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab is not None and "vocab_size" in token_ids and vocab < token_ids["vocab_size"]:
        problems.append(f"vocab_size {vocab} < the processor's {token_ids['vocab_size']} tokens")
    if problems:
        where = load or model.model_name
        raise ModelSourceError(
            f"the model ({where}) and its processor ({model.tokenizer or where}) disagree: "
            f"{'; '.join(problems)}. Pass --tokenizer with the processor the model was built "
            "for (a saved tiny model needs --tokenizer tiny and the tiny processor's ids: "
            "build_model(preset, **vlm_data.tokens.model_token_ids(tiny_processor())))"
        )
