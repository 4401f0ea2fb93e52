"""Where a train step's time goes, for ``bench_fsdp_train.py`` (``--host-phases``,
``--count-ops``, ``--profile``, ``--sync-debug``): the host time of each phase of an actor's
``train_step``, the aten ops one step dispatches, each place a step makes the host wait for the
GPU, and one step under ``torch.profiler`` (the actor's phases, the model's parts, kernels by
kind, GPU idle charged to what the host was launching) with the GPU timeline of a few steps.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from harness import sync

log = logging.getLogger("train_profile")


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
