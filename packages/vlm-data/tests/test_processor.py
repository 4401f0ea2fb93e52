from __future__ import annotations

import pytest
import torch
from PIL import Image

from vlm_data.processor import (
    QWEN3VL_ADDED_TOKENS,
    QWEN3VL_SPECIAL_TOKENS,
    build_processor,
    tiny_processor,
)
from vlm_data.synthetic import make_synthetic_rows


def test_tiny_processor_is_small_deterministic_and_has_qwen_special_tokens(tiny):
    tokenizer = tiny.tokenizer
    assert 300 <= len(tokenizer) <= 2048
    ids = tokenizer.convert_tokens_to_ids(list(QWEN3VL_SPECIAL_TOKENS + QWEN3VL_ADDED_TOKENS))
    assert len(set(ids)) == len(ids) and all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.unk_token_id not in ids or tokenizer.unk_token_id is None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tiny.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # Built twice: the same ids (a tiny model trained with one instance works with the next).
    again = tiny_processor()
    text = "How many dots? Answer: \\boxed{3}"
    assert again.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_tiny_tokenizer_round_trips_synthetic_and_geo3k_text(tiny, geo3k_validation):
    tokenizer = tiny.tokenizer
    texts = [r["problem"] for r in make_synthetic_rows(20, 0)]
    texts += [r["problem"] for r in make_synthetic_rows(5, 0, task="color")]
    texts += list(geo3k_validation["problem"]) + list(geo3k_validation["answer"])
    texts += ["<think>x = 3</think> Answer: \\boxed{5 \\sqrt { 13 }} — ünïcode ✓\r\n"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Digits are single tokens, so the synthetic answers are one token each.
    for digit in "12345":
        assert len(tokenizer(digit, add_special_tokens=False)["input_ids"]) == 1


def test_tiny_chat_template_renders_like_qwen3vl(tiny, real_processor):
    conversations = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}],
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image"},
                    {"type": "text", "text": "b"},
                    {"type": "image"},
                ],
            },
            {"role": "assistant", "content": "Answer: \\boxed{2}"},
        ],
        [{"role": "user", "content": "plain text"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = tiny.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            qwen = real_processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            assert ours == qwen


def test_tiny_processor_gives_few_image_tokens_matching_the_grid(tiny):
    text = "<|vision_start|><|image_pad|><|vision_end|>hi"
    out = tiny(text=[text], images=[Image.new("RGB", (64, 64), "white")], return_tensors="pt")
    grid = out["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]
    n_pad = int((out["input_ids"] == tiny.image_token_id).sum())
    assert n_pad == int(grid.prod()) // 4 == 4
    assert out["pixel_values"].shape == (16, 3 * 2 * 16 * 16)
    assert torch.equal(
        out["mm_token_type_ids"][0], (out["input_ids"][0] == tiny.image_token_id).long()
    )


def test_tiny_processor_save_and_reload(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    reloaded = build_processor(tmp_path)
    text = "<|im_start|>user\nHow many dots?<|im_end|>\n"
    assert reloaded.tokenizer(text)["input_ids"] == tiny.tokenizer(text)["input_ids"]
    assert len(reloaded.tokenizer) == len(tiny.tokenizer)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == tiny.apply_chat_template(
        messages, tokenize=False
    )


def test_build_processor_pixel_bounds_set_the_image_token_count(qwen3vl_dir):
    image = [Image.new("RGB", (420, 300), "white")]
    text = ["<|vision_start|><|image_pad|><|vision_end|>"]
    small = build_processor(qwen3vl_dir, min_pixels=32 * 32, max_pixels=128 * 128)
    large = build_processor(qwen3vl_dir, max_pixels=512 * 512)
    n_small = int(small(text=text, images=image)["image_grid_thw"][0].prod()) // 4
    n_large = int(large(text=text, images=image)["image_grid_thw"][0].prod()) // 4
    assert n_small * 32 * 32 <= 128 * 128 < n_large * 32 * 32
    with pytest.raises(ValueError, match="min_pixels"):
        build_processor(qwen3vl_dir, min_pixels=1000, max_pixels=10)


def test_build_processor_offline_hub_id_says_to_pass_a_local_folder(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network wait
    with pytest.raises(OSError, match="local folder"):
        build_processor("nonexistent-org/not-a-model-xyz")
