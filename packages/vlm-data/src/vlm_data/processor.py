"""Qwen3-VL processors: the real one from a folder or hub id, and a tiny one built offline in code.

The real processor applies Qwen3-VL's chat template, tokenizes, and turns images into flattened
patches (`pixel_values`) plus their patch grids (`image_grid_thw`). `tiny_processor()` builds a
processor of the same class and the same layout with a small byte-level BPE vocabulary, so that
tests and the `--preset tiny` run need nothing downloaded and a tiny model has a small embedding.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from transformers import AutoProcessor, PreTrainedTokenizerFast, Qwen3VLProcessor

logger = logging.getLogger(__name__)

#: Qwen3-VL's special tokens, in Qwen's order; the tiny tokenizer puts them after its BPE vocab.
QWEN3VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Added (non-special) tokens of Qwen3 that stay in decoded text.
QWEN3VL_ADDED_TOKENS: tuple[str, ...] = ("<think>", "</think>")

#: Image-side defaults of the tiny processor: a 64x64 image gives a 4x4 patch grid, i.e. 4 image
#: tokens after the 2x2 merge, so a tiny model sees only a few vision features per image.
TINY_PATCH_SIZE = 16
TINY_MERGE_SIZE = 2
TINY_MIN_PIXELS = 32 * 32
TINY_MAX_PIXELS = 64 * 64

# The same layout as Qwen3-VL's template (without tool calls): system, then each turn as
# <|im_start|>role\n ... <|im_end|>\n, images as <|vision_start|><|image_pad|><|vision_end|>.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A small deterministic corpus: the words of the synthetic tasks, geometry problems, LaTeX and
# the answer formats, so the common strings get their own merges. Byte-level BPE still encodes
# any text (every byte is in the base alphabet), so nothing is ever out of vocabulary.
_TINY_CORPUS: tuple[str, ...] = (
    "How many dots are in the image? Answer with a single number.",
    "How many red dots are there? Count the dots in the picture.",
    "Answer: \\boxed{1} Answer: \\boxed{2} Answer: \\boxed{3} Answer: \\boxed{4} Answer: \\boxed{5}",
    "The answer is \\boxed{3}. The final answer is \\boxed{42}.",
    "You FIRST think about the reasoning process as an internal monologue and then provide the "
    "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Find $m \\angle C$. Find x. Find y. Find the area of the figure. Round to the nearest tenth.",
    "Find the perimeter of the triangle. Find the length of $\\overline{AB}$. Find $x$ so that "
    "$m \\parallel n$. Find the measure of the angle. In $\\odot P$, find the radius.",
    "Line AB is tangent to the circle. Triangle ABC is isosceles. The quadrilateral is a "
    "rectangle, a square, a rhombus, a parallelogram, a trapezoid. Assume that segments that "
    "appear to be tangent are tangent.",
    "\\frac { 3 } { 7 } 5 \\sqrt { 13 } 2 \\sqrt { 3 } \\pi 180 90 45 30 60 sin cos tan",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 100 . , ; : ? ! ( ) [ ] { } = + - * /",
    "the of and to in is a that for it as with be on by this are at from or an which",
    "system\nYou are a helpful assistant.\nuser\nassistant\nWhat color is the square? red green blue",
)


def build_processor(
    path_or_id: str | Path,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Qwen3VLProcessor:
    """Load a Qwen3-VL processor from a local folder or a hub id, optionally bounding image size.

    `min_pixels`/`max_pixels` bound the resized image area (the images are resized so that each
    side is a multiple of patch_size * merge_size); they set the number of vision tokens per image.
    """
    source = str(path_or_id)
    try:
        processor = AutoProcessor.from_pretrained(source)
    except OSError as exc:
        if Path(source).exists():
            raise
        raise OSError(
            f"could not load the processor {source!r} from the hub ({exc.__class__.__name__}); "
            "without network, pass a local folder holding the model's tokenizer and processor "
            "files (e.g. ../shared/models/Qwen3-VL-4B-Instruct)"
        ) from exc
    set_pixel_bounds(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return processor


def set_pixel_bounds(
    processor: Qwen3VLProcessor, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> None:
    """Set the image processor's min/max pixel area in place (None keeps the current bound)."""
    if min_pixels is None and max_pixels is None:
        return
    image_processor = processor.image_processor
    lo = min_pixels if min_pixels is not None else image_processor.size.shortest_edge
    hi = max_pixels if max_pixels is not None else image_processor.size.longest_edge
    if lo > hi:
        raise ValueError(f"min_pixels ({lo}) must not exceed max_pixels ({hi})")
    new_size = {"shortest_edge": lo, "longest_edge": hi}
    processor.image_processor = type(image_processor)(
        **{**image_processor.to_dict(), "size": new_size}
    )
    logger.info("image pixel bounds set to [%s, %s]", lo, hi)


def _train_tiny_tokenizer(vocab_size: int):
    """Train a byte-level BPE (digits split one by one, as Qwen does) on the built-in corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_TINY_CORPUS) * 4, trainer=trainer)
    # Ids after the learned vocabulary, in Qwen's order: <|endoftext|> first, then the rest.
    tokenizer.add_special_tokens(list(QWEN3VL_SPECIAL_TOKENS))
    tokenizer.add_tokens(list(QWEN3VL_ADDED_TOKENS))
    return tokenizer


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    return _train_tiny_tokenizer(vocab_size).to_str()


def tiny_processor(
    *,
    vocab_size: int = 512,
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
) -> Qwen3VLProcessor:
    """A small Qwen3-VL processor built offline in code (deterministic: same ids on every call).

    The tokenizer is a byte-level BPE of `vocab_size` learned tokens followed by Qwen3-VL's special
    tokens; `len(processor.tokenizer)` is the vocabulary size a tiny model needs. The image
    processor is Qwen's (patch 16, merge 2) with small pixel bounds; the chat template renders the
    same message and image layout as Qwen3-VL's.
    """
    from tokenizers import Tokenizer
    from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    backend = Tokenizer.from_str(_tiny_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN3VL_SPECIAL_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessor(
        size=size,
        patch_size=TINY_PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=TINY_MERGE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        size=size, patch_size=TINY_PATCH_SIZE, merge_size=TINY_MERGE_SIZE
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=TINY_CHAT_TEMPLATE,
    )
