"""Colocated weight sync, as the GRPO loop runs it: Ray's object store vs CUDA IPC, per backend.

Builds an HF folder from a shape preset (random weights, the real Qwen3-VL processor from
``GLIMPSE_SHARED``), then on one GPU starts the loop's own actors, colocated with fractional
GPUs: a trainer rank (``rl_runtime.TrainGroup``: the FSDP or Megatron actor built from the
folder) and a transformers engine (``rl_runtime.RolloutGroup`` of ``HFEngine``). Before every
sync the engine's weights are zeroed; after it, every engine tensor must equal the folder's
bit for bit (an integer fingerprint of its bits) and the trainer must report every tensor sent.
Each transport syncs ``--repeats`` times (the first is reported apart: it opens handles and
warms allocators). Prints the median seconds of each and their ratio; ``--out`` writes JSON.

    # H200: the 2B shape, both backends (the device machine: wheels from .whl/, see gpu_suite.sh)
    python3 tools/bench/bench_weight_sync.py --out weight_sync.json
    # CPU smoke run: tiny model; "ipc" then moves CPU buffers by value through Ray
    uv run python tools/bench/bench_weight_sync.py --shape qwen3-vl-tiny --device cpu --backends fsdp
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_grpo_e2e import build_hf_folder
from harness import device_name, shared_dir, write_json

logger = logging.getLogger("bench_weight_sync")


def fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two integer sums over the tensor's bits: equal bits give equal sums, on any device."""
    flat = tensor.detach().contiguous().view(-1)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    ints = flat.view(bits).to(torch.int64)
    weights = torch.arange(ints.numel(), device=ints.device, dtype=torch.int64) % 65521 + 1
    return int(ints.sum()), int((ints * weights).sum())


def folder_fingerprints(folder: Path) -> dict[str, tuple[str, tuple[int, int]]]:
    """What the engine must hold after a sync: every tensor of the folder (the trainer starts
    from it, and the export is bit-exact), as (dtype, fingerprint)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(name)
                out[name] = (str(t.dtype).removeprefix("torch."), fingerprint(t))
    return out


# ------------------------------------------------------------- engine-side (in its actor)


def zero_weights(engine: Any) -> None:
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_fingerprints(engine: Any, wanted: dict[str, str]) -> dict[str, tuple[int, int]]:
    from rollout_sglang.hf.weights import WeightLoader

    loader = WeightLoader(engine.model)
    return {
        name: fingerprint(loader.target(name).to(getattr(torch, dtype)))
        for name, dtype in wanted.items()
    }


def make_engine(folder: str, device: str) -> Any:
    from rollout_sglang.hf.engine import HFEngine
    from vlm_models.build import build_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(folder, attn_implementation="sdpa", dtype=dtype, device=device)
    return HFEngine(model, device=device, max_batch_size=8)


def make_trainer(backend: str, folder: str, device: str) -> Any:
    if backend == "megatron":
        from trainers_megatron import MegatronConfig
        from trainers_megatron.actor import MegatronActor

        return MegatronActor(MegatronConfig(model=folder, compile=False))  # no forward runs here
    from trainers_fsdp import FsdpConfig
    from trainers_fsdp.actor import FsdpActor

    return FsdpActor(
        FsdpConfig(model=folder, device=device, attn_implementation="sdpa", compile=False)
    )


# ---------------------------------------------------------------------------- the driver


def run_backend(args: argparse.Namespace, backend: str, folder: Path, truth: dict) -> dict:
    from rl_runtime import RolloutGroup, TrainGroup, create_placement
    from weight_sync.cuda_ipc import CudaIpc
    from weight_sync.object_store import object_store

    use_gpu = args.device == "cuda"
    placement = create_placement(
        num_trainers=1, num_engines=1, colocate=True, use_gpu=use_gpu, cpus_per_bundle=1
    )
    groups: list[Any] = []
    result: dict[str, Any] = {"backend": backend}
    try:
        t0 = time.perf_counter()
        train = TrainGroup(
            functools.partial(make_trainer, backend, str(folder), args.device),
            world_size=1,
            placement=placement,
            num_cpus=0.5,
        )
        groups.append(train)
        rollout = RolloutGroup(
            functools.partial(make_engine, str(folder), args.device),
            num_engines=1,
            placement=placement,
            request_fn=lambda p: p,
            params_fn=dict,
            num_cpus=0.5,
        )
        groups.append(rollout)
        result["setup_s"] = round(time.perf_counter() - t0, 1)
        engine = rollout.workers[0]
        import ray

        wanted = {name: dtype for name, (dtype, _) in truth.items()}
        bucket_bytes = args.bucket_mb << 20
        for label, transport in (("object_store", object_store), ("ipc", CudaIpc())):
            rollout.transport = transport
            times, bad = [], []
            for _ in range(args.repeats):
                ray.get(engine.run.remote(zero_weights))
                t = time.perf_counter()
                sent = train.push_weights(rollout, bucket_bytes)
                times.append(time.perf_counter() - t)
                got = ray.get(engine.run.remote(engine_fingerprints, wanted))
                bad = [n for n, (_, fp) in truth.items() if got[n] != fp]
                if bad or sent != len(truth):
                    break
            result[label] = {
                "first_s": round(times[0], 3),
                "median_s": round(statistics.median(times[1:] or times), 3),
                "all_s": [round(t, 3) for t in times],
                "tensors_sent": sent,
                "tensors_expected": len(truth),
                "mismatched": bad[:10],
                "equal": not bad and sent == len(truth),
            }
            print(f"{backend} {label}: {result[label]}", flush=True)
        base, ipc = result["object_store"]["median_s"], result["ipc"]["median_s"]
        result["speedup"] = round(base / ipc, 1) if ipc else None
    finally:
        for g in groups:
            g.shutdown()
        placement.remove()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3-vl-2b", help="vlm_models shape or tiny preset")
    p.add_argument("--backends", default="fsdp,megatron")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--bucket-mb", type=int, default=256, help="the loop's --weight-bucket-mb")
    p.add_argument("--repeats", type=int, default=3, help="syncs per transport (first apart)")
    p.add_argument("--work-dir", default="/tmp/bench_weight_sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from rl_runtime import init_ray

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = shared_dir() / "models" / "Qwen3-VL-4B-Instruct"
    folder = build_hf_folder(args.shape, tokenizer, work / f"model_{args.shape}", args.seed)
    truth = folder_fingerprints(folder)
    print(f"model folder {folder}: {len(truth)} tensors, {time.perf_counter() - t0:.1f} s")
    init_ray(num_gpus=1 if args.device == "cuda" else None)
    import ray

    results = []
    for backend in [b for b in args.backends.split(",") if b]:
        try:
            results.append(run_backend(args, backend, folder, truth))
        except Exception as err:  # report the other backend all the same
            logger.exception("%s failed", backend)
            results.append({"backend": backend, "error": f"{type(err).__name__}: {err}"})
    for r in results:
        if "error" in r:
            print(f"{r['backend']:<9} FAILED {r['error']}")
            continue
        print(
            f"{r['backend']:<9} object store {r['object_store']['median_s']:7.3f} s   "
            f"CUDA IPC {r['ipc']['median_s']:7.3f} s   ratio {r['speedup']}x   "
            f"equal: {r['object_store']['equal']} / {r['ipc']['equal']}"
        )
    if args.out:
        meta = {
            "shape": args.shape,
            "bucket_mb": args.bucket_mb,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "argv": sys.argv,
        }
        if torch.cuda.is_available():
            meta["gpu"] = device_name("cuda")
        write_json(args.out, {"meta": meta, "results": results})
    ray.shutdown()


if __name__ == "__main__":
    main()
