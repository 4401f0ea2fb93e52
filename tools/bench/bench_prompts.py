"""Prompt-building throughput (rows/s) over geo3k: vlm_data.PromptBuilder vs the plain way.

Baseline, per row: decode the images with PIL, `processor.apply_chat_template(messages)`, then
`processor(text=..., images=...)` (which re-tokenizes the text after expanding every image into
hundreds of `<|image_pad|>` tokens). Ours: `PromptBuilder.build(row)` (same decoding, validation
and skip logic, image pads expanded in id space). Both run in the same process on the same rows,
taking turns; the ratio is printed and written as JSON.

    uv run tools/bench/bench_prompts.py --rows 300 --out /tmp/bench_prompts.json
    # GPU machine (torch/transformers only; pyarrow reads the parquet):
    PYTHONPATH=packages/vlm-data/src python tools/bench/bench_prompts.py --device cuda \
        --data ../shared/data/geo3k/validation.parquet \
        --model ../shared/models/Qwen3-VL-4B-Instruct --out bench_prompts_cuda.json
"""

from __future__ import annotations

import argparse
import io
import platform
import sys
from pathlib import Path

import torch
from harness import shared_dir, time_rounds, write_json
from PIL import Image

from vlm_data.processor import build_processor
from vlm_data.prompts import PromptBuilder


def read_rows(path: Path, limit: int) -> list[dict]:
    """geo3k rows with raw image dicts; pyarrow only, so no `datasets` is needed."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        sys.exit("bench_prompts needs pyarrow to read the parquet: pip install pyarrow")

    rows = pq.read_table(path, columns=["problem", "answer", "images"]).to_pylist()
    return rows[:limit] if limit else rows


def baseline(processor, rows: list[dict], device: str | None) -> int:
    kwargs = {"device": device} if device else {}
    for row in rows:
        images = [Image.open(io.BytesIO(im["bytes"])) for im in row["images"]]
        text = row["problem"].replace("<image>", "")
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        processor(text=[prompt], images=images, return_tensors="pt", **kwargs)
    return len(rows)


def ours(processor, rows: list[dict], device: str | None, workers: int = 0) -> int:
    builder = PromptBuilder(processor, image_device=device)
    built = sum(1 for _ in builder.build_all(rows, num_workers=workers))
    assert built == len(rows), builder.stats
    return built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = shared_dir()
    parser.add_argument("--data", type=Path, default=shared / "data/geo3k/validation.parquet")
    parser.add_argument("--model", type=Path, default=shared / "models/Qwen3-VL-4B-Instruct")
    parser.add_argument("--rows", type=int, default=0, help="rows to use (0: all)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each (median)")
    parser.add_argument("--device", default="cpu", help="where images are processed: cpu | cuda")
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes of the parallel variant (0: skip)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()

    device = None if args.device == "cpu" else args.device
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # this benchmark process only
    processor = build_processor(args.model)
    rows = read_rows(args.data, args.rows)
    # Warm-up (template compilation, kernel caches), then the timed passes.
    baseline(processor, rows[:4], device)
    ours(processor, rows[:4], device)
    variants = {
        "baseline": lambda: baseline(processor, rows, device),
        "ours": lambda: ours(processor, rows, device),
    }
    if args.workers > 0 and device is None:  # CUDA image processing stays in the main process
        variants["workers"] = lambda: ours(processor, rows, device, args.workers)
    # the variants take turns in every round; the median of each
    times = {k: t.median for k, t in time_rounds(variants, device, args.repeats).items()}
    t_base, t_ours, t_workers = times["baseline"], times["ours"], times.get("workers")
    result = {
        "benchmark": "prompt building (geo3k)",
        "rows": len(rows),
        "device": args.device,
        "baseline_rows_per_s": len(rows) / t_base,
        "ours_rows_per_s": len(rows) / t_ours,
        "speedup": t_base / t_ours,
        "workers": args.workers if t_workers else 0,
        "ours_workers_rows_per_s": len(rows) / t_workers if t_workers else None,
        "speedup_workers": t_base / t_workers if t_workers else None,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    print(
        f"rows={len(rows)} device={args.device}: baseline {result['baseline_rows_per_s']:.1f} rows/s,"
        f" ours {result['ours_rows_per_s']:.1f} rows/s, ratio {result['speedup']:.2f}x"
    )
    if t_workers:
        print(
            f"ours with {args.workers} worker processes: {result['ours_workers_rows_per_s']:.1f}"
            f" rows/s, ratio {result['speedup_workers']:.2f}x"
        )
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
