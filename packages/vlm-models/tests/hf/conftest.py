"""Real processor outputs from the geo3k validation parquet, shared by the HF-side tests."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image
from transformers import AutoProcessor, BatchFeature

# Small images keep CPU tests fast: 4..16 merged tokens per image.
IMAGE_SIZE = {"shortest_edge": 32 * 32 * 4, "longest_edge": 64 * 64 * 4}
# Qwen3.5-tiny uses Qwen3.5's token ids by default; feed it Qwen3-VL processor outputs.
_QWEN3_VL_IDS = dict(
    vocab_size=151936,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)


@pytest.fixture(scope="session")
def qwen3_vl_ids() -> dict[str, int]:
    """Overrides that make ``qwen3.5-tiny`` accept Qwen3-VL processor outputs."""
    return dict(_QWEN3_VL_IDS)


@pytest.fixture(scope="session")
def processor(qwen3vl_dir: Path):
    return AutoProcessor.from_pretrained(qwen3vl_dir)


@pytest.fixture(scope="session")
def geo3k_rows(geo3k_dir: Path) -> list[dict]:
    frame = pd.read_parquet(geo3k_dir / "validation.parquet").head(4)
    return frame.to_dict("records")


@pytest.fixture(scope="session")
def geo3k_images(geo3k_rows: list[dict]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in geo3k_rows]


def encode(processor, text: str, images: list[Image.Image]) -> BatchFeature:
    """One chat-formatted sample through the real Qwen3-VL processor (batch of 1)."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return processor(
        text=[prompt],
        images=images or None,
        return_tensors="pt",
        images_kwargs={"size": IMAGE_SIZE},
    )


@pytest.fixture(scope="session")
def samples(processor, geo3k_rows, geo3k_images) -> list[BatchFeature]:
    """One image, text only, two images: the mix a packed batch must handle."""
    problems = [r["problem"].replace("<image>", "").strip() for r in geo3k_rows]
    return [
        encode(processor, problems[0], geo3k_images[:1]),
        encode(processor, "Answer with a number only.", []),
        encode(processor, problems[1] + " " + problems[2], geo3k_images[1:3]),
    ]
