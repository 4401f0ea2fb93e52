"""Token ids a launcher reads from the processor: the response's stop tokens, the placeholders a
response must never contain, and the special ids a model built in code must share with it."""

from __future__ import annotations

from typing import Any

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def vision_token_ids(processor: Any) -> list[int]:
    """Image / video placeholder ids: a response containing one cannot be scored by a trainer
    (its image tokens would have no image)."""
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    return [i for i in ids if i is not None and i >= 0 and i != tok.unk_token_id]


def eos_token_ids(processor: Any) -> list[int]:
    """Ids that end a response: Qwen's turn end, its text end and the tokenizer's own EOS."""
    tok = processor.tokenizer
    ids = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(i for i in ids if i is not None and i >= 0)


def model_token_ids(processor: Any) -> dict[str, int]:
    """The vocabulary size and special ids of a Qwen3-VL config that must match the processor
    (`vlm_models.tiny_config(name, **model_token_ids(processor))`)."""
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return {
        "vocab_size": len(tok),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
    }
