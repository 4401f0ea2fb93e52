"""Dataset rows as the prompt and sample sources the loops index (`rl_runtime.PromptSource`),
built from a `DataConfig`: the synthetic task or `load_rows`, then a builder per row."""

from __future__ import annotations

import logging
from typing import Any

from vlm_data.config import DataConfig
from vlm_data.loading import DatasetLoadError, load_rows
from vlm_data.processor import build_processor, tiny_processor
from vlm_data.prompts import PromptBuilder
from vlm_data.sft import SftSampleBuilder
from vlm_data.synthetic import make_synthetic_rows

log = logging.getLogger(__name__)


class RowSource:
    """Rows and a builder (`PromptBuilder` or `SftSampleBuilder`): `get(i)` is row i's sample,
    or None for a bad row, logged and counted by the builder (`skipped`)."""

    def __init__(self, rows: Any, builder: Any) -> None:
        self.rows = rows
        self.builder = builder

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, index: int) -> Any | None:
        try:
            row = self.rows[index]
        except Exception as e:  # a row the dataset itself cannot decode
            log.warning("skipping row %d: cannot read it (%s)", index, e)
            self.builder.stats["unreadable"] += 1
            return None
        return self.builder.maybe_build(row, index)

    @property
    def skipped(self) -> int:
        return sum(n for reason, n in self.builder.stats.items() if reason != "built")

    @property
    def malformed_lines(self) -> int:
        """Lines of the data files dropped at load (never rows, so never drawn)."""
        return self.builder.stats["malformed_line"]


def load_split(
    data: DataConfig, split: str, *, eval_split: bool = False, seed: int = 0, stats: Any = None
) -> Any:
    """Rows of one split: the synthetic task, or `load_rows` (malformed lines are counted in
    `stats`, a builder's counter). A missing evaluation split falls back to 'validation'; a
    dataset that is not there raises `DatasetLoadError`."""
    task = data.synthetic_task
    if task is not None:
        n = data.synthetic_eval_size if eval_split else data.synthetic_train_size
        return make_synthetic_rows(n, seed=seed + (1 if eval_split else 0), task=task)
    keys = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key)
    keys |= {"stats": stats}
    try:
        return load_rows(data.dataset, split=split, **keys)
    except DatasetLoadError:
        if not eval_split or split == "validation":
            raise
        log.warning("no %r split in %s; evaluating on 'validation'", split, data.dataset)
        return load_rows(data.dataset, split="validation", **keys)


def prompt_builder(data: DataConfig, processor: Any) -> PromptBuilder:
    """Row -> rollout prompt as `data` says (template, length limit, columns)."""
    return PromptBuilder(
        processor,
        template=data.template,
        max_prompt_length=data.max_prompt_length,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        image_key=data.image_key,
    )


def sft_builder(data: DataConfig, processor: Any) -> SftSampleBuilder:
    """Row -> SFT sample (loss on the reply) as `data` says."""
    return SftSampleBuilder(
        processor,
        template=data.template,
        max_length=data.max_prompt_length,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        image_key=data.image_key,
    )


def prompt_source(
    data: DataConfig, processor: Any, split: str, *, eval_split: bool = False, seed: int = 0
) -> RowSource:
    """The rollout prompts of `split`."""
    builder = prompt_builder(data, processor)
    rows = load_split(data, split, eval_split=eval_split, seed=seed, stats=builder.stats)
    return RowSource(rows, builder)


def sft_source(data: DataConfig, processor: Any, *, seed: int = 0) -> RowSource:
    """The SFT samples of the training split (loss on the reply)."""
    builder = sft_builder(data, processor)
    rows = load_split(data, data.train_split, seed=seed, stats=builder.stats)
    return RowSource(rows, builder)


def load_processor(source: str, data: DataConfig) -> Any:
    """The processor of `source` (a folder or hub id; 'tiny': built offline) with the image
    bounds of `data`."""
    if source == "tiny":
        return tiny_processor()
    return build_processor(source, min_pixels=data.min_pixels, max_pixels=data.max_pixels)
