"""SFT samples: chat messages with their images, and a loss mask over the assistant's tokens.

Unlike the reference recipes' SFT paths, images are kept, so SFT trains the vision path too.
A sample is the prompt exactly as `PromptBuilder` encodes it (the ids a rollout would see)
followed by the assistant's reply up to and including its closing `<|im_end|>`, tokenized on its
own as a rollout would generate it. Following the token alignment convention of
docs/architecture.md, `loss_mask[t] = 1` where token `t` is a trained assistant token: the
reply and its `<|im_end|>`, never the prompt or the `<|im_start|>assistant\\n` header.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vlm_data.images import ImageError, ImageLoader
from vlm_data.loading import ANSWER_KEY, IMAGE_KEY, PROMPT_KEY
from vlm_data.prompts import (
    IMAGE_PLACEHOLDER,
    CountingBuilder,
    PromptBuilder,
    SkipReason,
    SkipRow,
    apply_template,
    split_placeholders,
)

logger = logging.getLogger(__name__)

MESSAGES_KEY = "messages"
END_OF_TURN = "<|im_end|>"


def format_answer(answer: Any) -> str:
    """The assistant reply of the geo3k SFT recipe: `Answer: \\boxed{<answer>}`."""
    return f"Answer: \\boxed{{{str(answer).strip()}}}"


def format_sft_messages(problem: str, answer: Any) -> list[dict[str, str]]:
    """Messages of the miles geo3k SFT recipe (the problem keeps its `<image>` placeholders)."""
    return [
        {"role": "user", "content": problem},
        {"role": "assistant", "content": format_answer(answer)},
    ]


@dataclass
class SftSample:
    """One SFT sample; every per-token tensor is aligned with `input_ids` (length L)."""

    index: int
    input_ids: torch.Tensor  # LongTensor[L]: prompt + reply + <|im_end|>
    loss_mask: torch.Tensor  # FloatTensor[L]: 1.0 on the reply tokens and <|im_end|>
    attention_mask: torch.Tensor  # LongTensor[L]
    pixel_values: torch.Tensor | None  # FloatTensor[P, D]
    image_grid_thw: torch.Tensor | None  # LongTensor[n, 3]
    mm_token_type_ids: torch.Tensor | None  # LongTensor[L]
    prompt_length: int
    text: str  # prompt + reply as rendered by the chat template

    def __len__(self) -> int:
        return int(self.input_ids.numel())


class SftSampleBuilder(CountingBuilder["SftSample"]):
    """Rows -> `SftSample`s, skipping and counting bad rows (the reasons of `SkipReason`).

    A row either has `messages` (as written by tools/format_geo3k_sft.py: user turns whose text
    holds `<image>` placeholders, the last turn the assistant's) plus `images`, or is a plain
    geo3k row (`problem`, `answer`, `images`) whose reply becomes `Answer: \\boxed{answer}`.
    The prompt template applies to the last user turn, as it does for rollout prompts.
    """

    kind = "SFT row"

    def __init__(
        self,
        processor: Any,
        *,
        template: str = "none",
        system_prompt: str | None = None,
        max_length: int | None = None,
        image_loader: ImageLoader | None = None,
        prompt_key: str = PROMPT_KEY,
        answer_key: str = ANSWER_KEY,
        image_key: str = IMAGE_KEY,
        messages_key: str = MESSAGES_KEY,
    ) -> None:
        self.prompts = PromptBuilder(
            processor,
            template=template,
            system_prompt=system_prompt,
            image_loader=image_loader,
            prompt_key=prompt_key,
            answer_key=answer_key,
            image_key=image_key,
        )
        self.max_length = max_length
        self.messages_key = messages_key
        super().__init__()

    def _messages(self, row: Mapping[str, Any], index: int) -> list[dict[str, Any]]:
        messages = row.get(self.messages_key)
        if messages:
            return [dict(m) for m in messages]
        problem = self.prompts.field(row, self.prompts.prompt_key, PROMPT_KEY)
        answer = self.prompts.field(row, self.prompts.answer_key, ANSWER_KEY)
        if not isinstance(problem, str) or not problem.strip():
            raise SkipRow(SkipReason.MISSING_PROMPT, f"row {index}: no messages and no problem")
        if answer is None or not str(answer).strip():
            raise SkipRow(SkipReason.MISSING_ANSWER, f"row {index}: empty answer")
        return format_sft_messages(problem, answer)

    def _build(self, row: Mapping[str, Any], index: int) -> SftSample:
        messages = self._messages(row, index)
        if messages[-1].get("role") != "assistant" or not str(messages[-1].get("content") or ""):
            raise SkipRow(SkipReason.MISSING_ANSWER, f"row {index}: no final assistant reply")
        images = self._images(row, messages, index)
        chat = self._chat(messages, images)
        builder = self.prompts
        prompt_text = builder.render(chat[:-1], add_generation_prompt=True)
        full_text = builder.render(chat, add_generation_prompt=False)
        if not full_text.startswith(prompt_text):
            raise ValueError("the chat template does not render the prompt as a prefix")
        reply = full_text[len(prompt_text) :]
        end = reply.rfind(END_OF_TURN)
        reply = reply[: end + len(END_OF_TURN)] if end >= 0 else reply
        try:
            prompt_ids, pixel_values, grid = builder.encode(prompt_text, images)
        except ValueError as exc:  # e.g. an aspect ratio over 200 the image processor refuses
            raise SkipRow(SkipReason.BAD_IMAGE, f"row {index}: image processor: {exc}") from exc
        reply_ids = torch.tensor(
            builder.tokenizer(reply, add_special_tokens=False)["input_ids"], dtype=torch.long
        )
        input_ids = torch.cat([prompt_ids, reply_ids])
        if self.max_length is not None and len(input_ids) > self.max_length:
            raise SkipRow(
                SkipReason.TOO_LONG,
                f"row {index}: {len(input_ids)} tokens > max_length {self.max_length}",
            )
        loss_mask = torch.zeros(len(input_ids), dtype=torch.float32)
        loss_mask[len(prompt_ids) :] = 1.0
        return SftSample(
            index=index,
            input_ids=input_ids,
            loss_mask=loss_mask,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == builder.image_token_id).long() if images else None,
            prompt_length=len(prompt_ids),
            text=prompt_text + reply,
        )

    def _images(
        self, row: Mapping[str, Any], messages: list[dict[str, Any]], index: int
    ) -> list[Image.Image]:
        raw = self.prompts.field(row, self.prompts.image_key, IMAGE_KEY) or []
        if not isinstance(raw, list | tuple):
            raw = [raw]
        placeholders = sum(
            m["content"].count(IMAGE_PLACEHOLDER)
            for m in messages
            if m.get("role") == "user" and isinstance(m.get("content"), str)
        )
        if placeholders != len(raw):
            reason = (
                SkipReason.NO_PLACEHOLDER if placeholders == 0 else SkipReason.IMAGE_COUNT_MISMATCH
            )
            raise SkipRow(
                reason,
                f"row {index}: {len(raw)} image(s) but {placeholders} {IMAGE_PLACEHOLDER} "
                "placeholder(s) in the user turns",
            )
        images = []
        for i, value in enumerate(raw):
            try:
                images.append(self.prompts.image_loader.load(value))
            except ImageError as exc:
                raise SkipRow(SkipReason.BAD_IMAGE, f"row {index}, image {i}: {exc}") from exc
        return images

    def _chat(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[dict]:
        """Interleave images into user turns (in placeholder order) and apply the template."""
        builder = self.prompts
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        chat: list[dict[str, Any]] = []
        if builder.system_prompt and messages[0].get("role") != "system":
            chat.append({"role": "system", "content": builder.system_prompt})
        used = 0
        for i, message in enumerate(messages):
            content = message.get("content")
            if message.get("role") == "user" and isinstance(content, str):
                text = apply_template(content, builder.template) if i == last_user else content
                n = text.count(IMAGE_PLACEHOLDER)
                content = split_placeholders(text, images[used : used + n])
                used += n
            chat.append({"role": message["role"], "content": content})
        return chat


def build_sft_sample(
    row: Mapping[str, Any], processor: Any, index: int = 0, **kwargs: Any
) -> SftSample:
    """One-off convenience: `SftSampleBuilder(processor, **kwargs).build(row, index)`."""
    return SftSampleBuilder(processor, **kwargs).build(row, index)


def collate_sft(samples: list[SftSample], *, pad_token_id: int = 0) -> dict[str, Any]:
    """Right-padded batch of SFT samples (loss_mask 0 on padding), image tensors concatenated."""
    longest = max(len(s) for s in samples)
    out = {
        "input_ids": torch.full((len(samples), longest), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(samples), longest), dtype=torch.long),
        "loss_mask": torch.zeros((len(samples), longest), dtype=torch.float32),
        "mm_token_type_ids": torch.zeros((len(samples), longest), dtype=torch.long),
    }
    for row, s in enumerate(samples):
        n = len(s)
        out["input_ids"][row, :n] = s.input_ids
        out["attention_mask"][row, :n] = s.attention_mask
        out["loss_mask"][row, :n] = s.loss_mask
        if s.mm_token_type_ids is not None:
            out["mm_token_type_ids"][row, :n] = s.mm_token_type_ids
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    out["pixel_values"] = torch.cat(pixels) if pixels else None
    out["image_grid_thw"] = torch.cat(grids) if grids else None
    out["lengths"] = torch.tensor([len(s) for s in samples], dtype=torch.long)
    return out
