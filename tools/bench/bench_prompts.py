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
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from vlm_data.processor import build_processor
from vlm_data.prompts import PromptBuilder

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"


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


def timed_rounds(variants: dict, repeats: int, sync: bool) -> dict[str, float]:
    """Median seconds per variant; the variants take turns in every round, so a burst of load
    from other jobs on a shared machine hits them alike instead of one of them."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            if sync:
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED / "data/geo3k/validation.parquet")
    parser.add_argument("--model", type=Path, default=SHARED / "models/Qwen3-VL-4B-Instruct")
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
    sync = device is not None and device.startswith("cuda")
    variants = {
        "baseline": lambda: baseline(processor, rows, device),
        "ours": lambda: ours(processor, rows, device),
    }
    if args.workers > 0 and device is None:  # CUDA image processing stays in the main process
        variants["workers"] = lambda: ours(processor, rows, device, args.workers)
    times = timed_rounds(variants, args.repeats, sync)
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
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
