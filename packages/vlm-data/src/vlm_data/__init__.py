"""vlm_data: image+question datasets into model-ready Qwen3-VL prompts (rollout, training, SFT)."""

from vlm_data.images import ImageError, ImageLoader
from vlm_data.loading import DatasetLoadError, load_rows
from vlm_data.processor import build_processor, set_pixel_bounds, tiny_processor
from vlm_data.prompts import (
    IMAGE_PLACEHOLDER,
    TEMPLATES,
    PromptBuilder,
    PromptSample,
    SkipReason,
    SkipRow,
    apply_template,
    collate,
    expand_image_pads,
    num_image_tokens,
    split_placeholders,
    user_messages,
)
from vlm_data.sft import (
    SftSample,
    SftSampleBuilder,
    build_sft_sample,
    collate_sft,
    format_answer,
    format_sft_messages,
)
from vlm_data.synthetic import make_synthetic_rows

__all__ = [
    "IMAGE_PLACEHOLDER",
    "TEMPLATES",
    "DatasetLoadError",
    "ImageError",
    "ImageLoader",
    "PromptBuilder",
    "PromptSample",
    "SftSample",
    "SftSampleBuilder",
    "SkipReason",
    "SkipRow",
    "apply_template",
    "build_processor",
    "build_sft_sample",
    "collate",
    "collate_sft",
    "expand_image_pads",
    "format_answer",
    "format_sft_messages",
    "load_rows",
    "make_synthetic_rows",
    "num_image_tokens",
    "set_pixel_bounds",
    "split_placeholders",
    "tiny_processor",
    "user_messages",
]
