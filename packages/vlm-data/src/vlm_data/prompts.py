"""Dataset rows -> chat prompts with images -> Qwen3-VL model inputs.

One code path serves rollout, training and SFT, so the token ids the rollout saw are exactly the
ids the trainer scores. The processor does the image work; the text side is tokenized once with
one `<|image_pad|>` per image and then expanded in id space to the number of vision features
each image yields (grid t*h*w / merge_size**2). That is the same id sequence the processor
produces (special tokens are split before BPE), without re-tokenizing a string holding hundreds
of pad tokens.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from PIL import Image

from vlm_data.config import TEMPLATES
from vlm_data.images import ImageError, ImageLoader
from vlm_data.loading import ANSWER_KEY, IMAGE_KEY, PROMPT_KEY

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"

T = TypeVar("T")


class SkipReason(enum.StrEnum):
    """Why a row was dropped; the keys of `PromptBuilder.stats`."""

    MISSING_PROMPT = "missing_prompt"
    MISSING_ANSWER = "missing_answer"
    NO_PLACEHOLDER = "no_placeholder"
    IMAGE_COUNT_MISMATCH = "image_count_mismatch"
    BAD_IMAGE = "bad_image"
    TOO_LONG = "too_long"


class SkipRow(ValueError):
    """A row that cannot become a sample; carries the reason and a message naming the row."""

    def __init__(self, reason: SkipReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class PromptSample:
    """One prompt, ready for the model. Shapes: L prompt tokens, P patches, n images."""

    index: int
    input_ids: torch.Tensor  # LongTensor[L]
    attention_mask: torch.Tensor  # LongTensor[L], all ones
    pixel_values: torch.Tensor | None  # FloatTensor[P, D], D = 3 * temporal_patch * patch**2
    image_grid_thw: torch.Tensor | None  # LongTensor[n, 3]
    mm_token_type_ids: torch.Tensor | None  # LongTensor[L], 1 at image pad tokens
    images: list[Image.Image]
    answer: str
    prompt_text: str  # the rendered chat template, one <|image_pad|> per image

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def apply_template(problem: str, template: str) -> str:
    """Wrap a problem in the named prompt template."""
    try:
        return TEMPLATES[template].format(
            problem=problem.strip() if template != "none" else problem
        )
    except KeyError:
        raise ValueError(
            f"unknown template {template!r}; choose from {sorted(TEMPLATES)}"
        ) from None


def split_placeholders(text: str, images: list[Any]) -> list[dict[str, Any]]:
    """Interleave text and images in placeholder order: "a<image>b" -> [text a, image, text b].

    The caller has checked that `len(images)` equals the number of placeholders.
    """
    parts = text.split(IMAGE_PLACEHOLDER)
    content: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        if i > 0:
            content.append({"type": "image", "image": images[i - 1]})
        if part:
            content.append({"type": "text", "text": part})
    return content


def user_messages(
    text: str, images: list[Any], system_prompt: str | None = None
) -> list[dict[str, Any]]:
    """Chat messages for one user turn with interleaved images (and an optional system turn)."""
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": split_placeholders(text, images)})
    return messages


class CountingBuilder(Generic[T]):
    """Row -> sample with every outcome counted in `stats` (by `SkipReason`, and "built").

    `build(row, index)` raises `SkipRow` for a bad row after counting it; `maybe_build` logs
    the message instead and returns None, so a long run skips the row and goes on.
    """

    kind = "row"  # how log lines name a row

    def __init__(self) -> None:
        self.stats: Counter[str] = Counter()

    def _build(self, row: Mapping[str, Any], index: int) -> T:
        raise NotImplementedError

    def build(self, row: Mapping[str, Any], index: int) -> T:
        try:
            sample = self._build(row, index)
        except SkipRow as skip:
            self.stats[skip.reason] += 1
            raise
        self.stats["built"] += 1
        return sample

    def maybe_build(self, row: Mapping[str, Any], index: int) -> T | None:
        try:
            return self.build(row, index)
        except SkipRow as skip:
            logger.warning("skipping %s %d (%s): %s", self.kind, index, skip.reason, skip)
            return None


class PromptBuilder(CountingBuilder["PromptSample"]):
    """Turns dataset rows into `PromptSample`s, skipping and counting the rows it cannot use.

    `build(row, index)` raises `SkipRow` for a bad row (after counting it in `stats`);
    `maybe_build` logs the message and returns None instead; `iter_samples` does that over rows.
    `image_device` ("cuda") runs the image resize/normalize there; pixel_values stay on it.
    """

    def __init__(
        self,
        processor: Any,
        *,
        template: str = "none",
        system_prompt: str | None = None,
        max_prompt_length: int | None = None,
        image_loader: ImageLoader | None = None,
        prompt_key: str = PROMPT_KEY,
        answer_key: str = ANSWER_KEY,
        image_key: str = IMAGE_KEY,
        image_device: str | torch.device | None = None,
    ) -> None:
        if template not in TEMPLATES:
            raise ValueError(f"unknown template {template!r}; choose from {sorted(TEMPLATES)}")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.template = template
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        self.image_loader = image_loader or ImageLoader()
        self.prompt_key, self.answer_key, self.image_key = prompt_key, answer_key, image_key
        self.image_token_id = int(processor.image_token_id)
        self.merge_length = int(processor.image_processor.merge_size) ** 2
        self.image_device = image_device
        super().__init__()

    # -- public -----------------------------------------------------------------------------

    def iter_samples(
        self, rows: Iterable[Mapping[str, Any]], start: int = 0
    ) -> Iterator[PromptSample]:
        for index, row in enumerate(rows, start):
            sample = self.maybe_build(row, index)
            if sample is not None:
                yield sample

    def build_all(
        self, rows: Sequence[Mapping[str, Any]], *, num_workers: int = 0, start: int = 0
    ) -> Iterator[PromptSample]:
        """Build every row in order, skipping (logging, counting) bad ones.

        num_workers > 0 builds in DataLoader worker processes, each with one torch thread: image
        processing of small images gains nothing from intra-op threads, and on a busy machine
        those threads cost several times the work itself. Where the calling process already
        runs one torch thread, in-process (0) avoids the worker start-up (docs/performance.md).
        """
        if num_workers <= 0:
            yield from self.iter_samples(rows, start)
            return
        from torch.utils.data import DataLoader

        loader = DataLoader(
            _BuildRows(self, rows, start),
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_identity,
            prefetch_factor=4,
        )
        for item in loader:
            if isinstance(item, PromptSample):
                self.stats["built"] += 1
                yield item
            else:
                reason, index, message = item
                self.stats[reason] += 1
                logger.warning("skipping row %d (%s): %s", index, reason, message)

    @property
    def num_skipped(self) -> int:
        return sum(n for reason, n in self.stats.items() if reason != "built")

    # -- steps ------------------------------------------------------------------------------

    def field(self, row: Mapping[str, Any], key: str, canonical: str) -> Any:
        """row[key], or row[canonical] for rows that `load_rows` already renamed."""
        return row[key] if key in row else row.get(canonical)

    def read_row(self, row: Mapping[str, Any], index: int) -> tuple[str, str, list[Image.Image]]:
        """Validate a row: (templated problem text, answer, decoded images)."""
        problem = self.field(row, self.prompt_key, PROMPT_KEY)
        if not isinstance(problem, str) or not problem.strip():
            raise SkipRow(SkipReason.MISSING_PROMPT, f"row {index}: no {self.prompt_key!r} text")
        answer = self.field(row, self.answer_key, ANSWER_KEY)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise SkipRow(SkipReason.MISSING_ANSWER, f"row {index}: empty {self.answer_key!r}")
        raw_images = self.field(row, self.image_key, IMAGE_KEY)
        if raw_images is None:
            raw_images = []
        elif not isinstance(raw_images, list | tuple):
            raw_images = [raw_images]
        placeholders = problem.count(IMAGE_PLACEHOLDER)
        if placeholders != len(raw_images):
            reason = (
                SkipReason.NO_PLACEHOLDER if placeholders == 0 else SkipReason.IMAGE_COUNT_MISMATCH
            )
            raise SkipRow(
                reason,
                f"row {index}: {len(raw_images)} image(s) but {placeholders} "
                f"{IMAGE_PLACEHOLDER} placeholder(s) in {self.prompt_key!r}",
            )
        images = []
        for i, value in enumerate(raw_images):
            try:
                images.append(self.image_loader.load(value))
            except ImageError as exc:
                raise SkipRow(SkipReason.BAD_IMAGE, f"row {index}, image {i}: {exc}") from exc
        return apply_template(problem, self.template), str(answer).strip(), images

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The chat template's text, one `<|image_pad|>` per image."""
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(
        self, text: str, images: list[Image.Image]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Token ids with image pads expanded, plus pixel_values and image_grid_thw."""
        ids = torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.long)
        if not images:
            return ids, None, None
        kwargs = {"device": self.image_device} if self.image_device is not None else {}
        vision = self.processor.image_processor(images=images, return_tensors="pt", **kwargs)
        grid = vision["image_grid_thw"].long().cpu()
        ids = expand_image_pads(ids, grid, self.image_token_id, self.merge_length)
        return ids, vision["pixel_values"], grid

    def _build(self, row: Mapping[str, Any], index: int) -> PromptSample:
        text, answer, images = self.read_row(row, index)
        prompt_text = self.render(user_messages(text, images, self.system_prompt))
        try:
            if self.max_prompt_length is not None:
                self._check_length(prompt_text, images, index)
            input_ids, pixel_values, grid = self.encode(prompt_text, images)
        except ValueError as exc:  # e.g. an aspect ratio over 200 the image processor refuses
            if isinstance(exc, SkipRow):
                raise
            raise SkipRow(SkipReason.BAD_IMAGE, f"row {index}: image processor: {exc}") from exc
        if self.max_prompt_length is not None and len(input_ids) > self.max_prompt_length:
            raise SkipRow(
                SkipReason.TOO_LONG,
                f"row {index}: prompt of {len(input_ids)} tokens > max_prompt_length "
                f"{self.max_prompt_length}",
            )
        return PromptSample(
            index=index,
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == self.image_token_id).long() if images else None,
            images=images,
            answer=answer,
            prompt_text=prompt_text,
        )

    def _check_length(self, prompt_text: str, images: list[Image.Image], index: int) -> None:
        """Cheap early drop: text tokens + image tokens from the resize arithmetic alone."""
        n_text = len(self.tokenizer(prompt_text)["input_ids"])
        n_image = sum(num_image_tokens(self.processor.image_processor, im) for im in images)
        total = n_text - len(images) + n_image
        if total > self.max_prompt_length:
            raise SkipRow(
                SkipReason.TOO_LONG,
                f"row {index}: prompt of {total} tokens ({n_image} image tokens) > "
                f"max_prompt_length {self.max_prompt_length}",
            )


class _BuildRows:
    """Map-style dataset for `build_all`'s workers; a skip comes back as (reason, index, message)."""

    def __init__(self, builder: PromptBuilder, rows: Sequence[Mapping[str, Any]], start: int):
        self.builder, self.rows, self.start = builder, rows, start

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptSample | tuple[str, int, str]:
        index = self.start + i
        try:
            return self.builder._build(self.rows[i], index)
        except SkipRow as skip:
            return (str(skip.reason), index, str(skip))


def _identity(item: Any) -> Any:
    return item


def expand_image_pads(
    ids: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int, merge_length: int
) -> torch.Tensor:
    """Repeat the i-th image pad token grid_i.prod() // merge_length times (in image order)."""
    is_pad = ids == image_token_id
    n_pads = int(is_pad.sum())
    if n_pads != len(image_grid_thw):
        raise ValueError(f"{n_pads} image pad tokens in the text but {len(image_grid_thw)} images")
    repeats = torch.ones_like(ids)
    repeats[is_pad] = image_grid_thw.prod(dim=-1) // merge_length
    return ids.repeat_interleave(repeats)


def num_image_tokens(image_processor: Any, image: Image.Image) -> int:
    """Vision features one image yields after resizing (without processing its pixels)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    size = image_processor.size
    height, width = smart_resize(
        image.height,
        image.width,
        factor=patch * merge,
        min_pixels=size.shortest_edge,
        max_pixels=size.longest_edge,
    )
    return (height // patch) * (width // patch) // (merge * merge)


def collate(
    samples: list[PromptSample], *, pad_token_id: int = 0, padding_side: str = "left"
) -> dict[str, Any]:
    """Batch variable-size samples: ids padded to the longest, image tensors concatenated.

    pixel_values are concatenated in sample order and image_grid_thw has one row per image, which
    is how Qwen3-VL's forward consumes a batch. Left padding suits generation; pass "right" for
    training-style batches.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    longest = max(len(s) for s in samples)
    batch_ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.long)
    batch_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    batch_mm = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample)
        span = slice(longest - n, longest) if padding_side == "left" else slice(0, n)
        batch_ids[row, span] = sample.input_ids
        batch_mask[row, span] = sample.attention_mask
        if sample.mm_token_type_ids is not None:
            batch_mm[row, span] = sample.mm_token_type_ids
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    return {
        "input_ids": batch_ids,
        "attention_mask": batch_mask,
        "mm_token_type_ids": batch_mm,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": torch.cat(grids) if grids else None,
        "lengths": torch.tensor([len(s) for s in samples], dtype=torch.long),
        "index": [s.index for s in samples],
        "answer": [s.answer for s in samples],
    }
