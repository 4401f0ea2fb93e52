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
launchers give the trainer (``--threads``); the step time is the run's wall time over its
steps. MFU = 6 * params * tokens / time / 989e12 (the H100 / H200 dense bf16 peak,
``harness.PEAK_BF16_FLOPS``), per GPU; ``mfu_flops`` counts the model FLOPs of
:mod:`vlm_models.flops` instead (the routed experts a token uses, attention over its sample,
the vision tower on its images): the MFU of an MoE model, where 6 * params would count every
expert for every token. World size comes from
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
import logging
import os
import sys
from pathlib import Path

import torch
from harness import device_name, emit, in_fresh_process, release, write_json
from train_measure import make_batch, measure, measure_actor, model_overrides
from train_profile import count_ops, profile_step, report_syncs

log = logging.getLogger("bench_fsdp_train")

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

    result = measure("baseline", step, args, device, params, model.config)
    if args.profile:
        profile_step(step, args.profile / "profile_baseline.txt", device, model)
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
    result, step, params = measure_actor(name, args, device, actor, actor.model, actor.model.config)
    # transformers' experts kernel of an MoE model ("grouped_mm": one grouped GEMM per projection)
    result["experts_implementation"] = getattr(
        actor.model.config.get_text_config(), "_experts_implementation", None
    )
    if changes:
        result["config_changes"] = changes
    if args.count_ops:
        result["aten_ops_per_step"] = count_ops(step)
        log.info("%-8s %d aten ops per step", name, result["aten_ops_per_step"])
    if args.sync_debug and actor.rank == 0 and device.type == "cuda":
        report_syncs(step, args.sync_debug / f"syncs_{name}.txt")
    return result, params, actor.world_size


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
    result, _, params = measure_actor(name, args, device, actor, actor.model, actor.hf_config)
    result["config_changes"] = MEGATRON[name]
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
        measured = (*run_baseline(args, device), 1)
    elif name in MEGATRON:
        measured = run_megatron(args, device, name)
    else:
        measured = run_ours(args, device, name, **({} if name == "ours" else VARIANTS[name]))
    release(device, compiled=True)  # the next configuration starts with the memory free
    return measured


def run_isolated(name: str) -> tuple[dict, int, int]:
    """One configuration in a fresh process (this script with ``--only name``), so that no
    configuration inherits another's allocator, compile or library state."""
    record = in_fresh_process(__file__, [*sys.argv[1:], "--only", name])
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
            emit({"result": result, "params": params, "world": world})
        return
    names = ([] if args.skip_baseline else ["baseline"]) + ["ours"] + names
    isolate = not args.same_process and "WORLD_SIZE" not in os.environ
    measured = {n: run_isolated(n) if isolate else run_config(n, args, device) for n in names}
    baseline = measured["baseline"][0] if "baseline" in measured else None
    ours, params, world = measured["ours"]
    variants = {n: measured[n][0] for n in names if n not in ("baseline", "ours")}
    result = {
        "device": device_name(device),
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
            write_json(args.out, result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _mfu(row: dict) -> str:
    return f"MFU {100 * row['mfu']:.1f}% (6N), {100 * row['mfu_flops']:.1f}% (model FLOPs)"


if __name__ == "__main__":
    main()
