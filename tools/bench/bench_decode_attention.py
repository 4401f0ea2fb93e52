"""Decode attention alone on a GPU: the engine's SDPA path against the Triton split-KV kernel.

One decode token per slot over a KV-cache layer ``[slots, kv_heads, seq_cap, head_dim]``, at
the head shapes of Qwen3-VL-2B (8 KV heads of 2 query heads, head_dim 128) and Qwen3.5-35B-A3B
(2 KV heads of 8, head_dim 256), for each batch size, live lengths drawn uniformly from
``--min-len`` to ``--kv-len`` (the bucket: the longest slot ends at its edge). Each side runs as
the engine runs it: captured in a CUDA graph (calls over a few cache layers in turn, together
larger than the L2 cache, so each call reads from HBM), timed over ``--iters`` replays with
CUDA events. Sides: ``sdpa`` (the engine's former path: SDPA over ``keys[:B, :, :kv_len]``
with the length mask), ``matmul``, ``triton`` (the split count of ``kv_splits``), and a sweep
of the kernel's split count and tiles (``triton s=N`` / ``triton n=BLOCK_N w=WARPS st=STAGES``).

Reported per side: microseconds per call (one layer), GB/s over the bytes of the *live* K/V
(what a step must read; the same numerator for every side, so GB/s ranks them), and that as a
fraction of the HBM bandwidth measured in the same run (``harness.measure_hbm_bandwidth``, a
4 GiB device copy); beside it the model's attention time per decode step (a call times its
attention layers) and the largest difference from SDPA.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_decode_attention.py \\
        --out $OUT/bench_decode_attention.json
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import describe, event_seconds, fraction, time_calls, write_json

from rollout_sglang.hf import decode_attention as da

# name: (KV heads, query heads per KV head, head_dim, attention layers in the model)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-vl-2b": (8, 2, 128, 28),
    "qwen3.5-35b-a3b": (2, 8, 256, 10),  # 40 layers, every 4th full attention
}
TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2)]  # BLOCK_N, warps, stages
L2_DEFEAT_BYTES = 512 << 20  # cache layers a graph cycles through hold at least this much


def time_graph(calls: list[Callable[[], Any]], iters: int) -> float:
    """Seconds per call: ``calls`` (one per cache layer) captured in one CUDA graph, replayed
    (on CPU, a smoke run under Triton's interpreter: the calls in turn, wall time)."""
    if not torch.cuda.is_available():
        return time_calls(lambda: [call() for call in calls]).total / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: builds kernels, picks SDPA's backend
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    seconds = event_seconds(lambda: [graph.replay() for _ in range(iters)])
    return seconds / (iters * len(calls))


def bench_shape(
    name: str, batch: int, args: argparse.Namespace, bandwidth: float | None
) -> list[dict[str, Any]]:
    kv_heads, group, head_dim, layers = SHAPES[name]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    seq_cap = args.seq_cap or args.kv_len
    g = torch.Generator(device=device).manual_seed(batch)
    lengths = torch.randint(args.min_len - 1, args.kv_len, (batch,), device=device, generator=g)
    lengths[0] = args.kv_len - 1  # the bucket's edge
    layer_bytes = 2 * batch * kv_heads * seq_cap * head_dim * size
    n_layers = max(2, math.ceil(L2_DEFEAT_BYTES / layer_bytes)) if device.type == "cuda" else 2
    shape = (batch, kv_heads, seq_cap, head_dim)
    keys = [torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(n_layers)]
    values = [torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(n_layers)]
    q = torch.randn(batch, kv_heads, group, head_dim, device=device, dtype=dtype, generator=g)
    kv_len, scale = args.kv_len, head_dim**-0.5
    mask = (torch.arange(kv_len, device=device)[None, :] <= lengths[:, None])[:, None, None, :]
    live_bytes = float((lengths + 1).sum()) * kv_heads * head_dim * 2 * size

    def sdpa(i: int) -> torch.Tensor:
        k, v = keys[i][:, :, :kv_len], values[i][:, :, :kv_len]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def matmul(i: int) -> torch.Tensor:
        k, v = keys[i][:, :, :kv_len], values[i][:, :, :kv_len]
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1).to(dtype), v)

    def triton(**kw: Any) -> Callable[[int], torch.Tensor]:
        return lambda i: da.decode_attention(q, keys[i], values[i], lengths, kv_len, scale, **kw)

    sides: dict[str, Callable[[int], torch.Tensor]] = {
        "sdpa": sdpa,
        "matmul": matmul,
        "triton": triton(),
    }
    policy, _ = da.kv_splits(
        batch, kv_heads, kv_len, sm_count=da._sm_count(q.device), block=da.block_n(head_dim)
    )
    for splits in args.splits:
        sides[f"triton s={splits}"] = triton(num_splits=splits)
    for block, warps, stages in TILES if args.tiles else []:
        sides[f"triton n={block} w={warps} st={stages}"] = triton(
            block=block, num_warps=warps, num_stages=stages
        )
    reference = sdpa(0).float()
    rows = []
    for side, fn in sides.items():
        row: dict[str, Any] = {"shape": name, "batch": batch, "side": side}
        try:
            diff = float((fn(0).float() - reference).abs().max())
            seconds = time_graph([lambda i=i, fn=fn: fn(i) for i in range(n_layers)], args.iters)
        except Exception as exc:  # one failing side (a tile that does not fit) still reports
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            continue
        gb_s = live_bytes / seconds / 1e9
        row.update(
            us=seconds * 1e6,
            gb_s=gb_s,
            hbm_fraction=fraction(gb_s, bandwidth),
            step_attention_ms=seconds * layers * 1e3,
            max_abs_diff=diff,
            splits=policy if side == "triton" else None,
            live_mb=live_bytes / 1e6,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"from {', '.join(SHAPES)}")
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--kv-len", type=int, default=768, help="the KV bucket")
    parser.add_argument(
        "--min-len", type=int, default=512, help="shortest live length (uniform up to --kv-len)"
    )
    parser.add_argument(
        "--seq-cap", type=int, default=None, help="cache tokens per slot (default --kv-len)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu: a smoke run of this script under TRITON_INTERPRET=1 (small shapes only)",
    )
    parser.add_argument("--iters", type=int, default=50, help="graph replays timed")
    parser.add_argument("--splits", default="1,2,4,8", help="split counts to sweep ('' for none)")
    parser.add_argument("--no-tiles", dest="tiles", action="store_false", help="skip the tiles")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    args.splits = [int(s) for s in args.splits.split(",") if s]
    device = torch.device(args.device)
    if device.type == "cpu" and not da.interpreted():
        raise SystemExit("on cpu, run with TRITON_INTERPRET=1 (a smoke run: tiny shapes)")
    chip = describe(device, hbm_gib=4.0)
    bandwidth = chip.hbm_gb_s
    print(chip)
    rows: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            kv_heads, group, head_dim, layers = SHAPES[name]
            print(
                f"\n{name} (kv_heads {kv_heads}, group {group}, head_dim {head_dim}, "
                f"{layers} attention layers) batch {batch}, kv {args.kv_len}",
                flush=True,
            )
            print(
                f"  {'side':26s} {'us/call':>9s} {'GB/s live':>10s} {'of HBM':>7s} "
                f"{'ms/step':>8s} {'max|diff|':>10s}"
            )
            shape_rows = bench_shape(name, batch, args, bandwidth)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the cache layers of this shape are gone
            for row in shape_rows:
                rows.append(row)
                if "error" in row:
                    print(f"  {row['side']:26s} FAILED {row['error']}", flush=True)
                    continue
                note = f" ({row['splits']} splits)" if row["splits"] else ""
                fraction = f"{row['hbm_fraction']:.1%}" if row["hbm_fraction"] else "n/a"
                print(
                    f"  {row['side']:26s} {row['us']:9.1f} {row['gb_s']:10.0f} "
                    f"{fraction:>7s} {row['step_attention_ms']:8.3f} "
                    f"{row['max_abs_diff']:10.2e}{note}",
                    flush=True,
                )
    result = {
        "bench": "bench_decode_attention",
        "device": chip.name,
        "torch": torch.__version__,
        "hbm_gb_s": bandwidth,
        "kv_len": args.kv_len,
        "min_len": args.min_len,
        "dtype": args.dtype,
        "rows": rows,
    }
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
