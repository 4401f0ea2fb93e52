"""Training throughput: plain transformers forward/backward + AdamW vs the FSDP actor's train_step.

Both run in the same process on the same synthetic batch: ``--batch`` samples of ``--seq-len``
tokens, each with one ``--image-size`` square image (512 -> a 32 x 32 patch grid -> 256 image
tokens after the 2 x 2 merge), at random init of a named shape (``--preset``).

- baseline: the model built in bfloat16 (params, grads and AdamW state), transformers' sdpa
  attention and Conv3d patch embedding, the batch as one padded ``[B, L]`` tensor with an
  attention mask, ``labels`` cross-entropy, ``torch.optim.AdamW`` (foreach);
- ours: ``trainers_fsdp.FsdpActor.train_step`` with its defaults (bf16 compute over fp32
  master weights and gradients: FSDP2 on several GPUs, flat master buffers on one; samples
  packed without padding to ``--max-tokens-per-gpu``, varlen attention within samples, layers
  and log-prob kernels compiled on CUDA, fused AdamW, GRPO or SFT loss); ``--variants eager``
  measures it uncompiled, ``--variants fsdp_one_rank`` wrapped in FSDP on one GPU too;
- ``--variants megatron``: the Megatron backend's ``MegatronActor.train_step`` (TP=1, same
  batch and token budget), so the default backend is measured against both in one run
  (``megatron-sequential``: MoE experts one GEMM pair each, megatron-core's ``SequentialMLP``,
  instead of the grouped GEMMs; ``megatron-compiled``: decoder layers compiled).

``--layers N`` cuts the shape to N decoder layers (``preset_config(name, num_hidden_layers=N)``,
random weights): Qwen3-VL-30B-A3B's 48 MoE layers do not fit one GPU with their optimizer state,
a few of them do, with every layer the same shape.

Each configuration (baseline, ours, each ``--variants`` entry) runs in a fresh process of its own
(``--same-process`` to run them in this one): in one process the first FSDP actor measured 20-27%
slower than the same configuration built after it, so a shared process makes the order matter.

Steps run back to back, as in a training loop (no device sync between them: the host may
prepare the next step while the GPU finishes this one), with Python's garbage collection
between steps as the trainer does it (``--python-gc``) and with torch's CPU threads as the
launchers give the trainer (``--threads``); the step time is the run's wall time
over its steps. MFU = 6 * params * tokens / time / 989e12 (H200 dense bf16 peak), per GPU;
``mfu_flops`` counts the model FLOPs of :mod:`vlm_models.flops` instead (the routed experts a
token uses, attention over its sample, the vision tower on its images): the MFU of an MoE
model, where 6 * params would count every expert for every token. World size comes from
the environment, so ``torchrun --nproc-per-node N`` measures N GPUs (the baseline then runs on
every GPU independently with the same per-GPU batch; ours shards one global batch of
``N * --batch`` samples). Prints both and the ratio; rank 0 writes ``--out`` JSON.

CPU (small):  uv run python tools/bench/bench_fsdp_train.py --device cpu --out /tmp/fsdp.json
MoE, both backends (H200): ... --preset qwen3-vl-30b-a3b --layers 4 --skip-baseline \\
                  --variants megatron,megatron-sequential --out moe_train.json
H200:         PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_fsdp_train.py \\
                  --device cuda --out fsdp_train.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("bench_fsdp_train")

H200_BF16_PEAK = 989e12

# --variants: FsdpConfig changes from the "ours" configuration, each measured on its own.
VARIANTS = {
    "again": {},  # ours once more: run-to-run spread (and, with --same-process, order effects)
    "compile": {"compile": True},
    "eager": {"compile": False},
    "unfused_norm": {"fused_rms_norm": False},
    "hf_vision_attn": {"fused_vision_attention": False},
    "fsdp_one_rank": {"shard_single_rank": True},  # FSDP even on one GPU (root unit)
    "layer_units": {"shard_layers": True, "shard_single_rank": True},
    "root_unit": {"shard_layers": False, "shard_single_rank": True},
    "keep_gathered": {"reshard_after_forward": False},  # several GPUs: no re-gather in backward
    "replicate": {"replicate": True},  # several GPUs: whole model each, one gradient all-reduce
    "ac": {"activation_checkpointing": True},
    "bf16_reduce": {"reduce_dtype": "bfloat16"},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--preset", default=None, help="model shape (default: qwen3-vl-2b on CUDA, tiny on CPU)"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="cut the shape to this many decoder layers (preset_config(..., num_hidden_layers=N))",
    )
    p.add_argument(
        "--batch", type=int, default=None, help="samples per GPU (default 8 CUDA, 4 CPU)"
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sample (1024 CUDA, 256 CPU)"
    )
    p.add_argument(
        "--image-size", type=int, default=None, help="image side in pixels (512 CUDA, 128 CPU)"
    )
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="default: batch * seq-len")
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches of --batch samples per optimizer step (gradient accumulation, as "
        "a GRPO step over a global batch runs): both paths step once per --accum micro-batches",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10 CUDA, 2 CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--loss", default="grpo", choices=["grpo", "sft"])
    p.add_argument("--attn", default="packed", help="ours: packed | sdpa | flash_attention_2")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ours: torch.compile each layer and the log-prob kernels (default: on CUDA)",
    )
    p.add_argument("--ac", action="store_true", help="ours: activation checkpointing")
    p.add_argument(
        "--no-fused-norm", action="store_true", help="ours: transformers' own RMSNorm forward"
    )
    p.add_argument(
        "--shard-layers",
        default="auto",
        choices=["auto", "yes", "no"],
        help="ours: FSDP unit per layer (yes), root only (no), auto: per layer when world > 1",
    )
    p.add_argument(
        "--variants",
        default="",
        help="extra configurations of ours, each measured after it, comma separated: "
        f"{', '.join(VARIANTS)}; or {', '.join(MEGATRON)} (the Megatron actor's "
        "train_step, TP=1: eager, compiled, compiled with megatron-core's per-parameter "
        "optimizer bookkeeping)",
    )
    p.add_argument(
        "--count-ops", action="store_true", help="count the aten ops one step of ours dispatches"
    )
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="profile one step of each configuration: profile_<name>.txt in this folder",
    )
    p.add_argument(
        "--sync-debug",
        type=Path,
        default=None,
        help="CUDA: run one more step of each configuration of ours with torch's sync debug "
        "mode and write each host-device sync with its Python stack to syncs_<name>.txt here",
    )
    p.add_argument(
        "--python-gc",
        default="periodic",
        choices=["periodic", "automatic"],
        help="periodic (default): no automatic collection during the timed steps, as the "
        "trainer runs (rl_runtime.PeriodicGC); automatic: Python's own, pauses mid-step",
    )
    p.add_argument(
        "--host-phases",
        action="store_true",
        help="ours: log each timed step's host time by phase (packing, forward/backward "
        "launch, waiting for the metrics, the update launch): finds host stalls",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's CPU threads (default: 1 on CUDA, as the launchers' trainer actors run: Ray "
        "sets OMP_NUM_THREADS to an actor's whole CPUs, 1 when colocated; torch's own on CPU)",
    )
    p.add_argument(
        "--same-process",
        action="store_true",
        help="measure every configuration in this process (default: each in a fresh one, "
        "except under torchrun)",
    )
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="JSON result path (rank 0)")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("qwen3-vl-2b" if cuda else "qwen3-vl-tiny")
    args.batch = args.batch or (8 if cuda else 4)
    args.seq_len = args.seq_len or (1024 if cuda else 256)
    args.image_size = args.image_size or (512 if cuda else 128)
    args.steps = args.steps or (10 if cuda else 2)
    args.max_tokens_per_gpu = args.max_tokens_per_gpu or args.batch * args.seq_len
    return args


def model_overrides(args) -> dict:
    """Tiny presets get a small vocabulary so the CPU run stays small; ``--layers`` cuts the
    shape (the config of ``preset_config(preset, num_hidden_layers=N)``)."""
    from trainers_fsdp.synthetic import TINY_OVERRIDES

    out = dict(TINY_OVERRIDES) if args.preset.endswith("tiny") else {}
    if args.layers:
        out["num_hidden_layers"] = args.layers
    return out


def model_flops_per_token(args, config) -> float:
    """Training FLOPs per token of one bench sample (:mod:`vlm_models.flops`: the language
    model's active matmuls and attention over the sample, plus the vision tower on its image),
    averaged over the sample's tokens."""
    from vlm_models.flops import flops_per_token, vision_flops

    side = args.image_size // config.vision_config.patch_size
    vision = vision_flops(config, [[1, side, side]]) / args.seq_len
    return flops_per_token(config, args.seq_len) + vision


def make_batch(args, config, n_samples: int, seed: int):
    from trainers_fsdp.synthetic import synthetic_batch

    patch = config.vision_config.patch_size
    side = args.image_size // patch
    return synthetic_batch(
        config,
        [args.seq_len] * n_samples,
        image_patches=[(side, side)] * n_samples,
        seed=seed,
        grpo=args.loss == "grpo",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step_fn, args, device) -> list[float]:
    """Seconds of each timed step, back to back as a training loop runs them: the device is
    synchronised only before the first and after the last, so the host may pack and launch
    step i+1 while the GPU finishes step i (each step's own host reads still wait). Each
    interval is host time between step starts; the last one runs to the final sync, so the
    intervals sum to the wall time of the whole run."""
    for _ in range(args.warmup):
        step_fn()
    periodic = args.python_gc == "periodic"
    if periodic:  # as rl_runtime.PeriodicGC runs the trainer: collect between steps only
        gc.collect()
        gc.freeze()
        gc.disable()
    sync(device)
    marks = [time.perf_counter()]
    for _ in range(args.steps):
        step_fn()
        marks.append(time.perf_counter())
    sync(device)
    marks[-1] = time.perf_counter()
    if periodic:
        gc.unfreeze()
        gc.enable()
    return [b - a for a, b in itertools.pairwise(marks)]


def tokens_per_step(args) -> int:
    """Tokens one GPU trains per optimizer step."""
    return args.accum * args.batch * args.seq_len


def summarize(
    name: str, times: list[float], tokens_per_gpu: int, params: int, device, flops_per_token: float
) -> dict:
    step = statistics.fmean(times)  # wall time of the run over its steps
    tps = tokens_per_gpu / step
    out = {
        "step_time_s": step,
        "step_times_s": times,
        "tokens_per_s_per_gpu": tps,
        "mfu": 6 * params * tps / H200_BF16_PEAK,
        "mfu_flops": flops_per_token * tps / H200_BF16_PEAK,
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    log.info(
        "%-8s step %.3f s  %.0f tokens/s/GPU  MFU %.1f%% (model FLOPs %.1f%%)",
        name,
        step,
        tps,
        100 * out["mfu"],
        100 * out["mfu_flops"],
    )
    return out


def run_baseline(args, device: torch.device) -> tuple[dict, int]:
    """Plain transformers: bf16 model, padded batch + mask, labels loss, AdamW."""
    from vlm_models.build import build_model

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(
        args.preset,
        dtype=dtype,
        attn_implementation="sdpa",
        fast_patch_embed=False,  # the original Conv3d: transformers' classes throughout
        **model_overrides(args),
    )
    model.to(device).train()
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    batch = make_batch(args, model.config, args.batch * args.accum, seed=1)

    def padded(start: int) -> dict:
        rows = slice(start, start + args.batch)
        ids = torch.stack(batch.input_ids[rows]).to(device)
        return dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.cat(batch.pixel_values[rows]).to(device, dtype),
            image_grid_thw=torch.cat(batch.image_grid_thw[rows]).to(device),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            labels=ids,
            use_cache=False,
        )

    micro = [padded(i * args.batch) for i in range(args.accum)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)

    def step():
        for inputs in micro:
            (model(**inputs).loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = time_steps(step, args, device)
    flops = model_flops_per_token(args, model.config)
    result = summarize("baseline", times, tokens_per_step(args), params, device, flops)
    if args.profile:
        profile_step(step, args.profile / "profile_baseline.txt", device, model)
    model = optimizer = micro = None  # free before building ours
    free(device)
    return result, params


def ours_config(args, device: torch.device, **changes):
    from rl_algos.optimizer import OptimConfig
    from trainers_fsdp import FsdpConfig

    cfg = dict(
        model=args.preset,
        model_overrides=model_overrides(args),
        device=str(device),
        attn_implementation=args.attn,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        activation_checkpointing=args.ac,
        compile=args.compile,
        fused_rms_norm=not args.no_fused_norm,
        shard_layers={"auto": None, "yes": True, "no": False}[args.shard_layers],
        log_entropy=True,
        optim=OptimConfig(lr=1e-6, weight_decay=0.01, max_grad_norm=1.0),
    )
    cfg.update(changes)
    return FsdpConfig(**cfg)


def run_ours(args, device: torch.device, name: str = "ours", **changes) -> tuple[dict, int, int]:
    from trainers_fsdp.actor import FsdpActor

    actor = FsdpActor(ours_config(args, device, **changes))
    params = sum(p.numel() for p in actor.model.parameters())
    batch = make_batch(args, actor.model.config, args.batch * args.accum, seed=1 + actor.rank)
    metrics = {}
    held = {"actor": actor, "batch": batch}  # cleared below so the next variant has the memory

    def step():
        metrics.update(held["actor"].train_step(held["batch"], loss=args.loss))

    phases = watch_host_phases(actor) if args.host_phases else None
    times = time_steps(step, args, device)
    flops = model_flops_per_token(args, actor.model.config)
    result = summarize(name, times, tokens_per_step(args), params, device, flops)
    # transformers' experts kernel of an MoE model ("grouped_mm": one grouped GEMM per projection)
    result["experts_implementation"] = getattr(
        actor.model.config.get_text_config(), "_experts_implementation", None
    )
    if phases is not None:
        result["host_phases_ms"] = log_host_phases(phases[-args.steps :])
    result["last_metrics"] = metrics
    if changes:
        result["config_changes"] = changes
    if args.count_ops:
        result["aten_ops_per_step"] = count_ops(step)
        log.info("%-8s %d aten ops per step", name, result["aten_ops_per_step"])
    if args.profile and actor.rank == 0:
        profile_step(step, args.profile / f"profile_{name}.txt", device, held["actor"].model)
        if device.type == "cuda":
            timeline_steps(step, args.profile / f"timeline_{name}.txt")
    if args.sync_debug and actor.rank == 0 and device.type == "cuda":
        report_syncs(step, args.sync_debug / f"syncs_{name}.txt")
    world = actor.world_size
    del actor, batch
    held.clear()
    free(device)
    return result, params, world


def log_host_phases(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    for i, row in enumerate(rows):
        log.info("step %d host ms: %s", i, "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
    return rows


def watch_host_phases(actor) -> list[dict[str, float]]:
    """Wrap the actor's step phases to record their host time, one dict per train_step: from
    the step's start to its first packed micro-batch (``pack``), to the metrics read
    (``launch``: forward and backward), the read itself (``wait``: the host waiting for the
    GPU), the update launch (``update``), and the time since the previous step ended
    (``between``). The packing's parts, summed over the step's micro-batches, follow:
    ``build`` (token ids, M-RoPE positions, loss fields), ``vision`` (the tower's inputs) and
    ``copy`` (pixels into pinned memory and every host-to-device copy); the pinned-memory
    stalls of the sixth round (docs/performance.md) showed in ``copy``."""
    from rl_algos import MicroBatches, StepMetrics
    from trainer_core import MicroBatch

    rows: list[dict[str, float]] = []
    marks: dict[str, float] = {}
    parts = dict.fromkeys(("build", "vision", "copy"), 0.0)
    plain = {n: getattr(actor, n) for n in ("train_step", "micro_batches", "apply_update")}
    plain_read = StepMetrics.read

    def timed(fn, key):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[key] += time.perf_counter() - t

        return run

    actor_module = sys.modules[type(actor).__module__]  # the FSDP or the Megatron actor's
    actor_module.build_micro_batch = timed(actor_module.build_micro_batch, "build")
    MicroBatch.to = timed(MicroBatch.to, "copy")
    if hasattr(actor, "_vision_inputs"):  # FSDP: one per model
        visions = list(actor._vision_inputs.values())
    else:  # Megatron: the first stage's
        visions = [actor.module.vision_inputs]
    for vision in visions:
        if vision is not None:
            vision.compute = timed(vision.compute, "vision")

    def train_step(*a, **k):
        marks["start"] = time.perf_counter()
        row = {"between": 1e3 * (marks["start"] - marks.get("end", marks["start"]))}
        parts.update(dict.fromkeys(parts, 0.0))
        out = plain["train_step"](*a, **k)
        marks["end"] = time.perf_counter()
        phases = {**marks.pop("phases"), **parts}
        rows.append({**row, **{k: 1e3 * v for k, v in phases.items()}})
        return out

    def micro_batches(*a, **k):
        built = plain["micro_batches"](*a, **k)

        def build(indices):
            mb = built.build(indices)
            marks.setdefault("packed", time.perf_counter())
            return mb

        marks.pop("packed", None)
        return MicroBatches(built.plan, build)

    def read(self, *a, **k):  # the step's one host read (rl_algos.StepMetrics.read)
        t = time.perf_counter()
        out = plain_read(self, *a, **k)
        marks["read"], marks["read_start"] = time.perf_counter(), t
        return out

    def update(*a, **k):
        t = time.perf_counter()
        out = plain["apply_update"](*a, **k)
        marks["phases"] = {
            "pack": marks["packed"] - marks["start"],
            "launch": marks["read_start"] - marks["packed"],
            "wait": marks["read"] - marks["read_start"],
            "update": time.perf_counter() - t,
        }
        return out

    StepMetrics.read = read
    actor.train_step, actor.micro_batches, actor.apply_update = train_step, micro_batches, update
    return rows


def free(device: torch.device) -> None:
    """Release the last configuration's memory (compiled graphs hold their modules too)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def count_ops(step_fn) -> int:
    """aten ops dispatched by one step (forward, backward, optimizer): the kernel launches a
    GPU step costs the host, measurable on CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        step_fn()
    return Counter.n


def report_syncs(step_fn, path: Path) -> None:
    """Each place one step makes the host wait for the GPU (torch.cuda sync debug mode), with
    the Python stack that led there, counted by place. Syncs from the autograd engine's thread
    have no Python caller and show only torch's frame."""
    import traceback
    import warnings

    seen: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        key = f"{message}\n{stack}"
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [f"{len(seen)} sync sites, {sum(seen.values())} syncs in one step", ""]
    for key, n in sorted(seen.items(), key=lambda kv: -kv[1]):
        lines += [f"===== {n}x {key}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    log.info("sync debug: %s", lines[0])


def profile_step(step_fn, path: Path, device: torch.device, model: torch.nn.Module) -> None:
    """One step under torch.profiler, written to ``path``: wall time against device busy time
    (the gap is the GPU waiting on the host), the actor's phase ranges and the model parts
    (vision tower, language model, LM head: forward only) with their host and device totals,
    then the ops that take the most device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    hooks = []
    for label, name in PROFILED_PARTS:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        hooks += _range_hooks(module, label)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step_fn()
        sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    for h in hooks:
        h.remove()
    busy_ms = _device_busy_ms(prof)
    ranges = [e for e in prof.key_averages() if e.key.startswith(RANGE_PREFIXES)]
    lines = [
        f"wall {wall_ms:.1f} ms, device busy {busy_ms:.1f} ms ({100 * busy_ms / wall_ms:.0f}%)",
        "",
        f"{'range':<24}{'calls':>6}{'host ms':>10}{'device ms':>11}",
    ]
    for e in sorted(ranges, key=lambda e: e.key):
        lines.append(
            f"{e.key:<24}{e.count:>6}{e.cpu_time_total / 1e3:>10.1f}"
            f"{e.device_time_total / 1e3:>11.1f}"
        )
    lines += ["", f"{'kernels by kind':<24}{'calls':>6}{'device ms':>11}"]
    for kind, (calls, ms) in kernel_kinds(prof).items():
        lines.append(f"{kind:<24}{calls:>6}{ms:>11.1f}")
    idle = idle_by_launch_range(prof)
    lines += ["", f"{'device idle before a kernel launched in':<44}{'ms':>8}"]
    lines += [f"{name:<44}{ms:>8.1f}" for name, ms in sorted(idle.items(), key=lambda kv: -kv[1])]
    syncs = sync_sites(prof)
    lines += ["", f"host waits on the device: {sum(syncs.values())}"]
    lines += [f"{n:>4}x {chain}" for chain, n in sorted(syncs.items(), key=lambda kv: -kv[1])]
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=90, max_name_column_width=60)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n\n" + table)
    log.info("profile: %s", lines[0])


# Profiler ranges the profile reports: the actors' phases and the model parts below.
RANGE_PREFIXES = ("fsdp_actor.", "megatron_actor.", "model.")

# Model parts timed in --profile (forward only). Compiled units (decoder layers, vision blocks)
# are left out: a hook there would be traced into their graphs.
PROFILED_PARTS = [
    ("model.vision", "model.visual"),
    ("model.vision.patch_embed", "model.visual.patch_embed"),
    ("model.vision.pos_embed", "model.visual.pos_embed"),
    ("model.vision.rotary", "model.visual.rotary_pos_emb"),
    ("model.vision.merger", "model.visual.merger"),
    *[("model.vision.deepstack", f"model.visual.deepstack_merger_list.{i}") for i in range(3)],
    ("model.text", "model.language_model"),
    ("model.text.embed", "model.language_model.embed_tokens"),
    ("model.text.rotary", "model.language_model.rotary_emb"),
    ("model.lm_head", "lm_head"),
    # the Megatron actor's model: megatron-core's DDP around Qwen3VLMegatronModel
    ("model.vision", "module.visual"),
    ("model.vision.patch_embed", "module.visual.patch_embed"),
    ("model.vision.merger", "module.visual.merger"),
    ("model.text", "module.language_model"),
    ("model.text.embed", "module.language_model.embedding"),
    ("model.lm_head", "module.language_model.output_layer"),
]


def _range_hooks(module: torch.nn.Module, label: str) -> list:
    """Forward hooks that open and close a profiler range named ``label`` around ``module``."""
    from torch.profiler import record_function

    open_ranges = []

    def pre(*_):
        r = record_function(label)
        r.__enter__()
        open_ranges.append(r)

    def post(*_):
        open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


# Device kernels sorted into kinds by name (first match wins), so that one profile says how the
# step splits into matmuls, attention, the optimizer, copies and the elementwise rest.
KERNEL_KINDS = [
    ("attention", ("flash", "fmha", "sdpa", "attention")),  # before gemm: FA names say cutlass
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("compiled (triton)", ("triton_",)),
    ("norm", ("layer_norm", "rms_norm", "gammabeta")),
    ("copy / cast / cat", ("memcpy", "copy", "cat", "split_with_sizes", "memset", "fill")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise",)),
]


def kernel_kinds(prof) -> dict[str, tuple[int, float]]:
    """Device kernel time (calls, ms) per kind of :data:`KERNEL_KINDS`, then "other"."""
    out: dict[str, list] = {kind: [0, 0.0] for kind, _ in KERNEL_KINDS} | {"other": [0, 0.0]}
    for e in _device_events(prof):
        name = e.name().lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other")
        out[kind][0] += 1
        out[kind][1] += e.duration_ns() / 1e6
    return {k: (n, ms) for k, (n, ms) in out.items() if n}


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def sync_sites(prof) -> dict[str, int]:
    """Host calls that wait for the GPU, each named by its chain of enclosing ops (outermost
    last three), counted. Unlike the sync debug mode this sees the autograd engine's thread."""
    out: dict[str, int] = {}
    for e in prof.events():
        if e.name not in SYNC_CALLS:
            continue
        chain, parent = [e.name], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        key = " < ".join(chain[:6])
        out[key] = out.get(key, 0) + 1
    return out


def _device_events(prof) -> list:
    """Kernels, copies and memsets on the GPU; not the ranges mirrored onto its timeline."""
    return [
        e
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
        and e.duration_ns() > 0
        and not e.is_user_annotation()
    ]


def idle_by_launch_range(prof) -> dict[str, float]:
    """Device idle time (ms) before each kernel, charged to the innermost profiler range (actor
    phase or model part) that was open on the host when that kernel was launched: where the GPU
    waited for the host, and on what. Kernels of the autograd thread fall in the range open on
    the main thread around ``backward()``."""
    events = list(prof.profiler.kineto_results.events())
    cpu = torch.autograd.DeviceType.CPU
    launched = {
        e.correlation_id(): e.start_ns()
        for e in events
        if e.device_type() == cpu and e.name().startswith(("cuda", "cu"))
    }
    ranges = sorted(
        (e.end_ns() - e.start_ns(), e.start_ns(), e.end_ns(), e.name())
        for e in events
        if e.device_type() == cpu and e.name().startswith(RANGE_PREFIXES)
    )
    out: dict[str, float] = {}
    end = None
    for k in sorted(_device_events(prof), key=lambda e: e.start_ns()):
        if end is not None and k.start_ns() > end:
            at = launched.get(k.correlation_id())
            name = "(launch not found)" if at is None else "(no range)"
            if at is not None:
                name = next((n for _, s, e, n in ranges if s <= at <= e), name)
            out[name] = out.get(name, 0.0) + (k.start_ns() - end) / 1e6
        end = k.end_ns() if end is None else max(end, k.end_ns())
    return out


def timeline_steps(step_fn, path: Path, steps: int = 3) -> None:
    """``steps`` back-to-back steps with only the GPU's activity recorded (no host-side op
    events, so the host runs near its unprofiled speed), written to ``path``: busy and idle
    time, then the longest stretches of GPU idle with their offset and the kernels around
    them. This is where the GPU waits on the host when nothing slows the host down."""
    from torch.profiler import ProfilerActivity, profile

    sync(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step_fn()
        sync(torch.device("cuda"))
        wall_ms = (time.perf_counter() - start) * 1e3
    events = sorted(_device_events(prof), key=lambda e: e.start_ns())
    t0 = events[0].start_ns()
    gaps, end, prev = [], events[0].end_ns(), events[0]
    for e in events[1:]:
        if e.start_ns() > end:
            gaps.append((e.start_ns() - end, end - t0, prev.name(), e.name()))
        if e.end_ns() > end:
            end, prev = e.end_ns(), e
    idle_ms = sum(g[0] for g in gaps) / 1e6
    span_ms = (end - t0) / 1e6
    lines = [
        f"{steps} steps: wall {wall_ms:.1f} ms, first to last kernel {span_ms:.1f} ms, "
        f"GPU idle {idle_ms:.1f} ms in {len(gaps)} gaps",
        "",
        f"{'idle us':>9}{'at ms':>9}  after -> before",
    ]
    for gap, at, before, after in sorted(gaps, reverse=True)[:40]:
        lines.append(f"{gap / 1e3:>9.0f}{at / 1e6:>9.1f}  {before[:50]} -> {after[:50]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log.info("timeline: %s", lines[0])


def _device_busy_ms(prof) -> float:
    """Time the GPU spent running kernels or copies (union of their intervals)."""
    spans = sorted((e.start_ns(), e.end_ns()) for e in _device_events(prof))
    busy, end = 0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1e6


def run_megatron(args, device: torch.device, name: str) -> tuple[dict, int, int]:
    """The Megatron backend's ``MegatronActor.train_step`` (TP=1, its defaults but for the
    variant's :data:`MEGATRON` changes) on the same batch and token budget: the default backend
    against the FSDP actor, same process kind. ``compile`` is set either way, so that the
    variants are eager or compiled on any device."""
    from rl_algos.optimizer import OptimConfig
    from trainers_megatron import MegatronConfig
    from trainers_megatron.actor import MegatronActor

    actor = MegatronActor(
        MegatronConfig(
            model=args.preset,
            model_overrides=model_overrides(args),
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            optim=OptimConfig(lr=1e-6, weight_decay=0.01, max_grad_norm=1.0),
            **MEGATRON[name],
        )
    )
    params = sum(p.numel() for p in actor.model.parameters())
    batch = make_batch(args, actor.hf_config, args.batch * args.accum, seed=1 + actor.rank)
    metrics: dict = {}

    def step():
        metrics.update(actor.train_step(batch, loss=args.loss))

    phases = watch_host_phases(actor) if args.host_phases else None
    times = time_steps(step, args, device)
    flops = model_flops_per_token(args, actor.hf_config)
    result = summarize(name, times, tokens_per_step(args), params, device, flops)
    result["config_changes"] = MEGATRON[name]
    if phases is not None:
        result["host_phases_ms"] = log_host_phases(phases[-args.steps :])
    result["last_metrics"] = metrics
    if args.profile and actor.rank == 0:
        profile_step(step, args.profile / f"profile_{name}.txt", device, actor.model)
        if device.type == "cuda":
            timeline_steps(step, args.profile / f"timeline_{name}.txt")
    return result, params, 1


# The Megatron actor's variants: MegatronConfig changes.
MEGATRON = {
    "megatron": {"compile": False},
    "megatron-compiled": {"compile": True},  # the default on CUDA
    # megatron-core's own per-parameter masters, gradients and copies (before 2026-12-02)
    "megatron-per-param": {"compile": True, "flat_masters": False},
    # MoE: megatron-core's SequentialMLP (one GEMM pair per expert), the trainer before #35
    "megatron-sequential": {"compile": False, "moe_grouped_gemm": False},
}


def run_config(name: str, args, device: torch.device) -> tuple[dict, int, int]:
    """One configuration in this process: ``baseline``, ``ours``, ``megatron`` or a variant."""
    if name == "baseline":
        result, params = run_baseline(args, device)
        return result, params, 1
    if name in MEGATRON:
        return run_megatron(args, device, name)
    return run_ours(args, device, name, **({} if name == "ours" else VARIANTS[name]))


def run_isolated(name: str) -> tuple[dict, int, int]:
    """One configuration in a fresh process (this script with ``--only name``), so that no
    configuration inherits another's allocator, compile or library state."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only", name]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    return record["result"], record["params"], record["world"]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    device = torch.device(args.device)
    if args.threads is None and device.type == "cuda":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    rank = int(os.environ.get("RANK", "0"))
    names = [n for n in args.variants.split(",") if n]
    for name in names:
        if name not in VARIANTS and name not in MEGATRON:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    if args.only:  # worker of run_isolated: one configuration, one JSON line
        result, params, world = run_config(args.only, args, device)
        if rank == 0:
            print(json.dumps({"result": result, "params": params, "world": world}))
        return
    names = ([] if args.skip_baseline else ["baseline"]) + ["ours"] + names
    isolate = not args.same_process and "WORLD_SIZE" not in os.environ
    measured = {n: run_isolated(n) if isolate else run_config(n, args, device) for n in names}
    baseline = measured["baseline"][0] if "baseline" in measured else None
    ours, params, world = measured["ours"]
    variants = {n: measured[n][0] for n in names if n not in ("baseline", "ours")}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "world_size": world,
        "preset": args.preset,
        "layers": args.layers,
        "params": params,
        "batch_per_gpu": args.batch,
        "accum": args.accum,
        "seq_len": args.seq_len,
        "image_size": args.image_size,
        "max_tokens_per_gpu": args.max_tokens_per_gpu,
        "loss": args.loss,
        "attn": args.attn,
        "compile": args.compile,
        "activation_checkpointing": args.ac,
        "fused_rms_norm": not args.no_fused_norm,
        "shard_layers": args.shard_layers,
        "isolated": isolate,
        "threads": torch.get_num_threads(),
        "baseline": baseline,
        "ours": ours,
        "variants": variants,
    }
    if baseline:
        result["speedup"] = ours["tokens_per_s_per_gpu"] / baseline["tokens_per_s_per_gpu"]
    if rank == 0:
        line = f"ours {ours['tokens_per_s_per_gpu']:.0f} tok/s/GPU, {_mfu(ours)}"
        if baseline:
            line = (
                f"baseline {baseline['tokens_per_s_per_gpu']:.0f} tok/s/GPU "
                f"({_mfu(baseline)}) | {line} | ratio {result['speedup']:.2f}x"
            )
        print(line)
        for name, v in variants.items():
            print(
                f"  variant {name}: {v['tokens_per_s_per_gpu']:.0f} tok/s/GPU, {_mfu(v)}, "
                f"x{v['tokens_per_s_per_gpu'] / ours['tokens_per_s_per_gpu']:.2f} vs ours"
            )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _mfu(row: dict) -> str:
    return f"MFU {100 * row['mfu']:.1f}% (6N), {100 * row['mfu_flops']:.1f}% (model FLOPs)"


if __name__ == "__main__":
    main()
