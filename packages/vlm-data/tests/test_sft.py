from __future__ import annotations

import importlib.util
from pathlib import Path

import datasets
import pytest
import torch

from vlm_data.loading import load_rows
from vlm_data.prompts import PromptBuilder, SkipReason, SkipRow
from vlm_data.sft import SftSampleBuilder, collate_sft, format_sft_messages
from vlm_data.synthetic import make_synthetic_rows

ROOT = Path(__file__).resolve().parents[3]


def _format_tool():
    """tools/format_geo3k_sft.py as a module (run in-process: a subprocess costs ~30 s here)."""
    spec = importlib.util.spec_from_file_location(
        "format_geo3k_sft", ROOT / "tools" / "format_geo3k_sft.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_mask_covers_the_reply_and_im_end_only(real_processor, geo3k_validation):
    tokenizer = real_processor.tokenizer
    builder = SftSampleBuilder(real_processor)
    for index in (0, 5, 123):
        row = geo3k_validation[index]
        sample = builder.build(row, index)
        assert sample.loss_mask.dtype == torch.float32 and len(sample.loss_mask) == len(sample)
        trained = sample.input_ids[sample.loss_mask.bool()]
        assert tokenizer.decode(trained) == f"Answer: \\boxed{{{row['answer']}}}<|im_end|>"
        assert trained[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        # The mask is one contiguous block at the end, right after the generation header.
        start = sample.prompt_length
        assert sample.loss_mask[:start].sum() == 0 and bool(sample.loss_mask[start:].all())
        header = tokenizer.decode(sample.input_ids[:start])
        assert header.endswith("<|im_start|>assistant\n")
        # The prompt part is exactly what a rollout would be given for the same row.
        prompt = PromptBuilder(real_processor).build(row, index)
        assert torch.equal(sample.input_ids[:start], prompt.input_ids)
        assert torch.equal(sample.pixel_values, prompt.pixel_values)
        # The whole sample equals the processor's encoding of the full chat text.
        reference = real_processor(text=[sample.text], images=prompt.images, return_tensors="pt")
        assert torch.equal(reference["input_ids"][0], sample.input_ids)
        assert torch.equal(reference["mm_token_type_ids"][0], sample.mm_token_type_ids)


def test_sft_with_tiny_processor_and_synthetic_rows(tiny):
    rows = make_synthetic_rows(4, seed=2)
    builder = SftSampleBuilder(tiny, system_prompt="Count.")
    samples = [builder.build(row, i) for i, row in enumerate(rows)]
    for sample, row in zip(samples, rows, strict=True):
        trained = tiny.tokenizer.decode(sample.input_ids[sample.loss_mask.bool()])
        assert trained == f"Answer: \\boxed{{{row['answer']}}}<|im_end|>"
        assert sample.text.startswith("<|im_start|>system\nCount.<|im_end|>\n")
        assert int((sample.input_ids == tiny.image_token_id).sum()) == 4
    batch = collate_sft(samples, pad_token_id=tiny.tokenizer.pad_token_id)
    assert batch["loss_mask"].sum() == sum(s.loss_mask.sum() for s in samples)
    assert batch["pixel_values"].shape[0] == sum(s.pixel_values.shape[0] for s in samples)


def test_bad_sft_rows_are_skipped_with_a_reason(tiny):
    builder = SftSampleBuilder(tiny, max_length=40)
    good = make_synthetic_rows(1, seed=0)[0]
    cases = {
        SkipReason.MISSING_ANSWER: {**good, "answer": None},
        SkipReason.NO_PLACEHOLDER: {**good, "problem": "How many?"},
        SkipReason.BAD_IMAGE: {**good, "images": [{"bytes": b"nope", "path": "z.png"}]},
        SkipReason.IMAGE_COUNT_MISMATCH: {**good, "problem": "<image><image>How many?"},
        SkipReason.TOO_LONG: {**good, "problem": "<image>" + "many words " * 40},
    }
    for reason, row in cases.items():
        with pytest.raises(SkipRow) as info:
            builder.build(row, 9)
        assert info.value.reason == reason and "row 9" in str(info.value)
    assert builder.maybe_build(good, 0) is not None
    assert builder.stats["built"] == 1 and sum(builder.stats.values()) == 6


def test_format_tool_writes_messages_and_keeps_images(tmp_path, geo3k_dir, real_processor):
    source = tmp_path / "src"
    source.mkdir()
    subset = datasets.Dataset.from_parquet(str(geo3k_dir / "validation.parquet")).select(range(6))
    subset.to_parquet(str(source / "train.parquet"))
    out = tmp_path / "out" / "train_formatted.parquet"
    argv = ["--dataset", str(source), "--split", "train", "--output", str(out)]
    assert _format_tool().main(argv) == 0
    formatted = datasets.Dataset.from_parquet(str(out))
    assert formatted.features["images"] == subset.features["images"]
    for row, original in zip(formatted, subset, strict=True):
        assert row["messages"] == format_sft_messages(original["problem"], original["answer"])
        assert row["messages"][1]["content"] == f"Answer: \\boxed{{{original['answer']}}}"
    rows = load_rows(out)
    builder = SftSampleBuilder(real_processor)
    sample = builder.build(rows[2], 2)
    assert sample.pixel_values is not None
    assert real_processor.tokenizer.decode(sample.input_ids[sample.loss_mask.bool()]).startswith(
        "Answer: \\boxed{"
    )


def test_format_tool_offline_hub_name_fails_with_a_clear_message(tmp_path, monkeypatch, caplog):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    argv = ["--dataset", "nobody/no-such-dataset-xyz", "--output", str(tmp_path / "x.parquet")]
    with caplog.at_level("ERROR"):
        assert _format_tool().main(argv) == 2
    assert "pass a local parquet/JSONL file or folder" in caplog.text
    assert not (tmp_path / "x.parquet").exists()
