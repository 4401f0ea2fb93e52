"""vlm_data: image+question datasets into model-ready Qwen3-VL prompts (rollout, training, SFT).

`DataConfig` (and `TEMPLATES`) import at once; every other name loads its module on first use,
since those import transformers (seconds) and a launcher parses its flags without them.
"""

import importlib
from typing import Any

from vlm_data.config import SYNTHETIC, TEMPLATES, DataConfig

_EXPORTS: dict[str, tuple[str, ...]] = {
    "images": ("ImageError", "ImageLoader"),
    "loading": ("DatasetLoadError", "load_rows"),
    "processor": ("build_processor", "set_pixel_bounds", "tiny_processor"),
    "prompts": (
        "IMAGE_PLACEHOLDER",
        "PromptBuilder",
        "PromptSample",
        "SkipReason",
        "SkipRow",
        "apply_template",
        "collate",
        "expand_image_pads",
        "num_image_tokens",
        "split_placeholders",
        "user_messages",
    ),
    "sft": (
        "SftSample",
        "SftSampleBuilder",
        "build_sft_sample",
        "collate_sft",
        "format_answer",
        "format_sft_messages",
    ),
    "sources": ("RowSource", "load_processor", "load_split", "prompt_source", "sft_source"),
    "synthetic": ("make_synthetic_rows",),
    "tokens": ("eos_token_ids", "model_token_ids", "vision_token_ids"),
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


__all__ = ["SYNTHETIC", "TEMPLATES", "DataConfig", *_LAZY]
