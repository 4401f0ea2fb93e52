"""The FSDP trainer's model phase on one rank: a bf16 checkpoint widened to float32 on load
(the baseline) against loaded as stored (``build_model(narrow_dtype=bfloat16)``), each followed
by the flat float32 masters and bf16 compute weights the actor makes of it
(``trainers_fsdp.master.MasterWeights``, ``--host-fraction`` of the masters on the host).

Each variant runs in a fresh process (its own page faults and peak resident memory), on the
same folder, alternating, ``--repeats`` times; the median is printed with the ratio. The folder
is the preset's shape with random weights, cut to ``--layers`` decoder layers, built once
in ``--work-dir`` by ``tools/bench/bench_grpo_e2e.py``'s builder, under its name (so a GPU call
after ``gpu_suite.sh e2e`` reuses that folder: ``gpu_suite.sh model_load``).

    uv run python tools/bench/bench_model_load.py --shape qwen3-vl-2b --layers 14 \
        --device cpu --out /tmp/model_load.json

The physical limit beside the ratio: the bytes each variant must move through host memory
(:data:`BYTES_PER_PARAM`, reads and writes counted) against a large host copy timed in the same
run (its read and write bytes counted alike). On a GPU the device part of the masters crosses
the host link too; the fraction is then a lower bound on the host side only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import time
from pathlib import Path

from bench_grpo_e2e import build_hf_folder
from harness import copy_bandwidth_gb_s, device_name, shared_dir, write_json

#: host memory traffic per parameter, reads and writes: the checkpoint read (2, bf16), the
#: float32 masters written (4), the bf16 compute weights and zeroed gradient written (2 + 2);
#: widened first, the float32 model is also written (4) and read again by the masters (4, in
#: place of the 2-byte read)
BYTES_PER_PARAM = {"as_stored": 2 + 4 + 2 + 2, "widened": 2 + 4 + 4 + 4 + 2 + 2}


def _one(folder: str, narrow: bool, device: str, host_fraction: float, queue) -> None:
    import torch

    from trainers_fsdp.master import MasterWeights
    from vlm_models.build import build_model

    start = time.perf_counter()
    model = build_model(folder, narrow_dtype=torch.bfloat16 if narrow else None)
    loaded = time.perf_counter()
    masters = MasterWeights(
        model, torch.bfloat16, torch.device(device), host_fraction=host_fraction
    )
    if device == "cuda":
        torch.cuda.synchronize()
    done = time.perf_counter()
    queue.put(
        {
            "load_s": loaded - start,
            "masters_s": done - loaded,
            "total_s": done - start,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "params": sum(p.numel() for p in masters.module.parameters()),
        }
    )


def run(folder: Path, narrow: bool, device: str, host_fraction: float) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_one, args=(str(folder), narrow, device, host_fraction, queue))
    child.start()
    out = queue.get()
    child.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-vl-2b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--host-fraction", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_grpo_e2e"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    name = f"model_{args.shape}" + (f"_{args.layers}l" if args.layers else "")
    tokenizer = shared_dir() / "models" / "Qwen3-VL-4B-Instruct"
    folder = build_hf_folder(args.shape, tokenizer, args.work_dir / name, 0, args.layers)
    runs: dict[str, list[dict[str, float]]] = {"widened": [], "as_stored": []}
    for _ in range(args.repeats):
        for key, narrow in (("widened", False), ("as_stored", True)):
            runs[key].append(run(folder, narrow, args.device, args.host_fraction))
            print(key, json.dumps(runs[key][-1]), flush=True)
    rate = copy_bandwidth_gb_s("cpu", gib=2, repeats=3)  # what host traffic is held to
    median = {
        key: {m: statistics.median(r[m] for r in rows) for m in rows[0]}
        for key, rows in runs.items()
    }
    ratio = median["widened"]["total_s"] / median["as_stored"]["total_s"]
    print(f"host copy: {rate:.1f} GB/s (read + write)")
    for key, m in median.items():
        m["traffic_gb"] = BYTES_PER_PARAM[key] * m["params"] / 1e9
        m["limit_s"] = m["traffic_gb"] / rate
        print(
            f"{key:>9}: load {m['load_s']:.2f} s, masters {m['masters_s']:.2f} s, "
            f"total {m['total_s']:.2f} s, peak resident {m['peak_rss_gib']:.1f} GiB; "
            f"{m['traffic_gb']:.1f} GB of host traffic, {m['limit_s']:.2f} s at the copy rate "
            f"({100 * m['limit_s'] / m['total_s']:.0f} % of it)"
        )
    print(
        f"{name}, {median['as_stored']['params'] / 1e9:.2f}B params on {args.device}: "
        f"as stored {ratio:.2f}x the widened load"
    )
    if args.out:
        record = {
            "shape": name,
            "device": args.device,
            "host": device_name("cpu"),
            "host_fraction": args.host_fraction,
            "host_copy_gb_s": rate,
            "runs": runs,
            "median": median,
            "ratio": ratio,
        }
        write_json(args.out, record)


if __name__ == "__main__":
    main()
