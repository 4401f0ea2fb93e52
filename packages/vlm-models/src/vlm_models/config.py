"""`ModelConfig`: which model to train and which processor goes with it. Plain data, light to
import: the launchers parse it (and refuse a bad value) before transformers loads."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The reference recipes' Qwen3-VL models (a bare name is looked up under `HUB_NAMESPACE`).
SUPPORTED_MODELS = (
    "Qwen3-VL-2B-Instruct",
    "Qwen3-VL-4B-Instruct",
    "Qwen3-VL-8B-Instruct",
    "Qwen3-VL-30B-A3B-Instruct",
    "Qwen3-VL-235B-A22B-Instruct",
    "Qwen3-VL-2B-Thinking",
    "Qwen3-VL-4B-Thinking",
    "Qwen3-VL-8B-Thinking",
    "Qwen3-VL-30B-A3B-Thinking",
    "Qwen3-VL-235B-A22B-Thinking",
    "Qwen3.5-35B-A3B",  # the slime recipe's (gated delta net + MoE)
)
HUB_NAMESPACE = "Qwen"  # a bare name such as Qwen3-VL-8B-Instruct is Qwen/Qwen3-VL-8B-Instruct
TINY_MODEL = "qwen3-vl-tiny"
#: Names of the built-in shapes of `vlm_models.presets` (random weights; the Qwen3.5 ones need
#: a transformers that has Qwen3.5), known here without importing transformers.
PRESET_NAMES = (
    "qwen3-vl-2b",
    "qwen3-vl-4b",
    "qwen3-vl-8b",
    "qwen3-vl-30b-a3b",
    "qwen3.5-35b-a3b",
    TINY_MODEL,
    "qwen3-vl-moe-tiny",
    "qwen3.5-tiny",
    "qwen3.5-moe-tiny",
)
#: Hub names whose architecture a shape preset has: a layout is estimated before downloading.
SHAPE_OF_NAME = {
    "Qwen3-VL-2B-": "qwen3-vl-2b",
    "Qwen3-VL-4B-": "qwen3-vl-4b",
    "Qwen3-VL-8B-": "qwen3-vl-8b",
    "Qwen3-VL-30B-A3B-": "qwen3-vl-30b-a3b",
    "Qwen3.5-35B-A3B": "qwen3.5-35b-a3b",  # where transformers has Qwen3.5
}


class ModelSourceError(ValueError):
    """A model name that names no preset, no folder and no reachable hub model (one line)."""


@dataclass
class ModelConfig:
    """The model's name (resolved by `vlm_models.resolve_model` before anything starts) and
    the processor's source."""

    model_name: str = field(
        default="Qwen3-VL-8B-Instruct",
        metadata={
            "help": f"model: a name of {', '.join(SUPPORTED_MODELS[:3])}..., a hub id, a local "
            f"folder, or '{TINY_MODEL}' (random init)"
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "processor source: a folder or hub id, 'tiny' (built offline); default: "
            "the model's"
        },
    )
