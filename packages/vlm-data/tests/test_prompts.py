from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from vlm_data.prompts import (
    PromptBuilder,
    SkipReason,
    SkipRow,
    apply_template,
    collate,
    split_placeholders,
)
from vlm_data.synthetic import make_synthetic_rows


def _png(size=(40, 30), color=(200, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _check_vision_tokens(sample, processor):
    """Each image: <|vision_start|>, exactly grid.prod()/merge**2 pads, <|vision_end|>."""
    ids = sample.input_ids
    merge = processor.image_processor.merge_size
    starts = (ids == processor.vision_start_token_id).nonzero().flatten().tolist()
    assert len(starts) == len(sample.image_grid_thw)
    for start, grid in zip(starts, sample.image_grid_thw, strict=True):
        n = int(grid.prod()) // merge**2
        assert torch.all(ids[start + 1 : start + 1 + n] == processor.image_token_id)
        assert ids[start + 1 + n] == processor.vision_end_token_id
    n_features = int(sample.image_grid_thw.prod(dim=-1).sum()) // merge**2
    assert int((ids == processor.image_token_id).sum()) == n_features
    assert sample.pixel_values.shape[0] == int(sample.image_grid_thw.prod(dim=-1).sum())
    assert torch.equal(sample.mm_token_type_ids, (ids == processor.image_token_id).long())


def _build_all_and_check(processor, rows) -> None:
    builder = PromptBuilder(processor, template="none")
    # Worker processes (one torch thread each): ~4x faster than in-process on a busy machine.
    samples = list(builder.build_all(rows, num_workers=2))
    assert len(samples) == len(rows) and builder.stats == {"built": len(rows)}
    for sample, row in zip(samples, rows, strict=True):
        _check_vision_tokens(sample, processor)
        assert sample.answer == row["answer"].strip()
        assert sample.prompt_text.startswith("<|im_start|>user\n<|vision_start|>")
        assert sample.prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        # The problem text (placeholder removed) survives tokenization unchanged.
        decoded = processor.tokenizer.decode(sample.input_ids)
        assert row["problem"].replace("<image>", "") in decoded


def test_every_geo3k_validation_row_builds_with_the_real_processor(
    real_processor, geo3k_validation
):
    _build_all_and_check(real_processor, list(geo3k_validation))


def test_ids_and_pixels_equal_the_processors_own_output(real_processor, geo3k_validation):
    builder = PromptBuilder(real_processor, template="think-boxed", system_prompt="Be exact.")
    for index in range(0, 300, 37):
        sample = builder.build(geo3k_validation[index], index)
        reference = real_processor(
            text=[sample.prompt_text], images=sample.images, return_tensors="pt"
        )
        assert torch.equal(reference["input_ids"][0], sample.input_ids)
        assert torch.equal(reference["mm_token_type_ids"][0], sample.mm_token_type_ids)
        assert torch.equal(reference["image_grid_thw"], sample.image_grid_thw)
        assert torch.equal(reference["pixel_values"], sample.pixel_values)


def test_templates_and_system_prompt(real_processor):
    problem = "<image>Find x."
    assert apply_template(problem, "none") == problem
    assert apply_template(problem, "boxed").endswith("within \\boxed{}.")
    think = apply_template(problem, "think-boxed")
    assert think.startswith(problem) and "<think> </think>" in think and "\\boxed{}" in think
    with pytest.raises(ValueError, match="unknown template"):
        PromptBuilder(real_processor, template="fancy")
    row = {"problem": problem, "answer": "3", "images": [{"bytes": _png(), "path": None}]}
    sample = PromptBuilder(real_processor, template="boxed", system_prompt="SYS").build(row, 0)
    assert sample.prompt_text.startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\n")
    assert "Find x.\nPlease reason step by step" in sample.prompt_text


def test_placeholders_split_into_interleaved_items_in_order(real_processor):
    a, b = "img-a", "img-b"
    assert split_placeholders("one<image>two<image>", [a, b]) == [
        {"type": "text", "text": "one"},
        {"type": "image", "image": a},
        {"type": "text", "text": "two"},
        {"type": "image", "image": b},
    ]
    red, blue = _png(color=(255, 0, 0)), _png(size=(80, 20), color=(0, 0, 255))
    row = {"problem": "Left<image>mid<image>right", "answer": "1", "images": [red, blue]}
    sample = PromptBuilder(real_processor).build(row, 0)
    assert (
        "Left<|vision_start|><|image_pad|><|vision_end|>mid<|vision_start|>" in sample.prompt_text
    )
    assert [im.getpixel((0, 0)) for im in sample.images] == [(255, 0, 0), (0, 0, 255)]
    _check_vision_tokens(sample, real_processor)
    text = real_processor.tokenizer.decode(sample.input_ids)
    assert text.index("Left") < text.index("mid") < text.index("right")


def test_bad_rows_are_skipped_counted_and_named(real_processor, caplog):
    good = {"problem": "<image>ok", "answer": "2", "images": [_png()]}
    rows = [
        good,
        {"problem": "<image>no answer", "answer": None, "images": [_png()]},
        {"problem": "<image>blank answer", "answer": "  ", "images": [_png()]},
        {
            "problem": "<image>broken",
            "answer": "1",
            "images": [{"bytes": b"\x89PNGxx", "path": "d.png"}],
        },
        {"problem": "no placeholder", "answer": "1", "images": [_png()]},
        {"problem": "<image><image>two", "answer": "1", "images": [_png()]},
        {"problem": "", "answer": "1", "images": []},
        {"problem": "text only, fine", "answer": "4", "images": []},
    ]
    builder = PromptBuilder(real_processor)
    with caplog.at_level("WARNING"):
        samples = list(builder.iter_samples(rows))
    assert [s.index for s in samples] == [0, 7]
    assert samples[1].pixel_values is None and samples[1].image_grid_thw is None
    assert builder.stats == {
        "built": 2,
        SkipReason.MISSING_ANSWER: 2,
        SkipReason.BAD_IMAGE: 1,
        SkipReason.NO_PLACEHOLDER: 1,
        SkipReason.IMAGE_COUNT_MISMATCH: 1,
        SkipReason.MISSING_PROMPT: 1,
    }
    assert builder.num_skipped == 6
    assert "row 3, image 0: corrupt" in caplog.text and "d.png" in caplog.text
    assert "row 4: 1 image(s) but 0 <image> placeholder(s)" in caplog.text
    with pytest.raises(SkipRow) as info:
        builder.build(rows[5], 5)
    assert info.value.reason == SkipReason.IMAGE_COUNT_MISMATCH


def test_too_long_prompts_are_dropped_never_truncated(real_processor, geo3k_validation):
    full = PromptBuilder(real_processor).build(geo3k_validation[0], 0)
    n = len(full)
    at_limit = PromptBuilder(real_processor, max_prompt_length=n)
    assert torch.equal(at_limit.build(geo3k_validation[0], 0).input_ids, full.input_ids)
    below = PromptBuilder(real_processor, max_prompt_length=n - 1)
    with pytest.raises(SkipRow, match=f"prompt of {n} tokens") as info:
        below.build(geo3k_validation[0], 0)
    assert info.value.reason == SkipReason.TOO_LONG and below.stats[SkipReason.TOO_LONG] == 1


def test_collate_pads_and_concatenates_images(tiny):
    rows = make_synthetic_rows(3, seed=4)
    rows[1]["problem"] = "<image>" + "How many dots are there in this small picture? " * 3
    builder = PromptBuilder(tiny)
    samples = [builder.build(row, i) for i, row in enumerate(rows)]
    lengths = [len(s) for s in samples]
    pad = tiny.tokenizer.pad_token_id
    for side in ("left", "right"):
        batch = collate(samples, pad_token_id=pad, padding_side=side)
        assert batch["input_ids"].shape == (3, max(lengths))
        assert batch["lengths"].tolist() == lengths
        for row, sample in enumerate(samples):
            mask = batch["attention_mask"][row].bool()
            assert torch.equal(batch["input_ids"][row][mask], sample.input_ids)
            assert torch.all(batch["input_ids"][row][~mask] == pad)
            assert torch.equal(batch["mm_token_type_ids"][row][mask], sample.mm_token_type_ids)
            assert mask[0 if side == "right" else -1]
        assert torch.equal(batch["pixel_values"], torch.cat([s.pixel_values for s in samples]))
        assert batch["image_grid_thw"].shape == (3, 3)
        assert batch["answer"] == [r["answer"] for r in rows]


def test_build_all_in_worker_processes_keeps_order_and_counts_skips(tiny, caplog):
    rows = make_synthetic_rows(7, seed=5)
    rows[3] = {**rows[3], "images": [{"bytes": b"bad", "path": "bad.png"}]}
    serial = PromptBuilder(tiny)
    expected = list(serial.build_all(rows))
    parallel = PromptBuilder(tiny)
    with caplog.at_level("WARNING"):
        got = list(parallel.build_all(rows, num_workers=2))
    assert [s.index for s in got] == [0, 1, 2, 4, 5, 6] == [s.index for s in expected]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)
    assert parallel.stats == serial.stats == {"built": 6, SkipReason.BAD_IMAGE: 1}
    assert "skipping row 3 (bad_image)" in caplog.text


def test_image_the_processor_refuses_is_a_skipped_row(tiny):
    row = {"problem": "<image>thin", "answer": "1", "images": [_png(size=(600, 2))]}
    for max_len in (None, 100):
        builder = PromptBuilder(tiny, max_prompt_length=max_len)
        assert builder.maybe_build(row, 0) is None
        assert builder.stats == {SkipReason.BAD_IMAGE: 1}
