"""Format geo3k (or any image+question set) for SFT, as the miles geo3k recipe does.

Adds `messages` = [user: the problem (with its <image> placeholders), assistant:
"Answer: \\boxed{<answer>}"] to every row, keeps the images column (and every other column), and
writes one parquet file. Works offline on a local parquet/JSONL file or folder.

    uv run tools/format_geo3k_sft.py --dataset ../shared/data/geo3k --split train \
        --output /tmp/geo3k_train_formatted.parquet
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import datasets

from vlm_data.loading import DatasetLoadError, load_rows
from vlm_data.sft import format_sft_messages

logger = logging.getLogger("format_geo3k_sft")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="hub name or local parquet/JSONL path")
    parser.add_argument("--split", default="train", help="split to format (default: train)")
    parser.add_argument("--output", required=True, type=Path, help="output .parquet file")
    parser.add_argument("--prompt-key", default="problem", help="column holding the problem")
    parser.add_argument("--answer-key", default="answer", help="column holding the answer")
    parser.add_argument("--image-key", default="images", help="column holding the images")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        rows = load_rows(
            args.dataset,
            split=args.split,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            image_key=args.image_key,
        )
    except DatasetLoadError as exc:
        logger.error("%s", exc)
        return 2
    before = len(rows)
    rows = rows.filter(
        lambda row: row["answer"] is not None and str(row["answer"]).strip() != "",
        desc="dropping rows without an answer",
    )
    if len(rows) < before:
        logger.warning("dropped %d row(s) without an answer", before - len(rows))
    rows = rows.map(
        lambda row: {"messages": format_sft_messages(row["problem"], row["answer"])},
        desc="formatting messages",
    )
    rows = _decoded_images(rows)  # the same image feature as the source's hub copies
    args.output.parent.mkdir(parents=True, exist_ok=True)
    rows.to_parquet(str(args.output))
    logger.info("wrote %d rows to %s", len(rows), args.output)
    return 0


def _decoded_images(rows: datasets.Dataset) -> datasets.Dataset:
    feature = rows.features.get("images")
    inner = getattr(feature, "feature", feature)
    if isinstance(inner, datasets.Image) and not inner.decode:
        image = datasets.Image()
        rows = rows.cast_column("images", image if inner is feature else datasets.List(image))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
