"""Dataset rows as prompt and SFT sources: a text-only JSONL (no image column) goes the same
path as image rows, its samples without pixels."""

from __future__ import annotations

import json
from pathlib import Path

from vlm_data import DataConfig
from vlm_data.processor import tiny_processor
from vlm_data.sources import prompt_source, sft_source


def test_a_jsonl_without_images_gives_text_only_prompts_and_sft_samples(tmp_path: Path):
    path = tmp_path / "problems.jsonl"
    rows = [{"question": "What is 1 + 2?", "answer": "3"}, {"question": "", "answer": "4"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = DataConfig(dataset=str(path), prompt_key="question", template="boxed")
    processor = tiny_processor()
    prompts = prompt_source(data, processor, "train")
    sample = prompts.get(0)
    assert sample.answer == "3" and "What is 1 + 2?" in sample.prompt_text
    assert sample.pixel_values is None and sample.image_grid_thw is None
    assert sample.mm_token_type_ids is None and sample.images == []
    assert prompts.get(1) is None and prompts.skipped == 1  # no question: skipped, counted
    sft = sft_source(data, processor).get(0)
    assert sft.pixel_values is None and sft.mm_token_type_ids is None
    reply = processor.tokenizer.decode(sft.input_ids[sft.loss_mask.bool()])
    assert reply.startswith("Answer: \\boxed{3}")
