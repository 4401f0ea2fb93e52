"""Will the training layout fit? Memory per GPU, estimated before anything starts.

Plain arithmetic on numbers the app passes in (rl-runtime imports no model or trainer code):
the model's shape (:class:`ModelShape`), the layout (:class:`TrainLayout`), the trainer config
(a :class:`~rl_runtime.protocols.TrainerConfig`) and the GPU's memory. The backend says what
one GPU holds of its weights, gradients, optimizer state, activations and logits
(``TrainerConfig.state_bytes``: trainers_fsdp.memory, trainers_megatron.memory, which also
give the measurements they were checked against); rl-runtime adds a fixed reserve for the CUDA
context, NCCL buffers and allocator fragmentation, compares with the GPU and, when a layout
does not fit, tries others: more tensor parallelism and recomputation on the same backend,
context parallelism for long samples, the other backends the app offers, fewer tokens. It is
an estimate to refuse layouts that cannot work, slightly on the safe side, not a promise that
a layout will.

Host memory counts too: a layout may keep part of the optimizer state (float32 masters and
AdamW moments) on the host and step it there (``ParallelLayout.optimizer_offload``, the
launchers' ``--optimizer-cpu-offload``); the backend says what that leaves on the GPU and
puts on the host (``StateBytes.host``: every byte of the trainer's state there, allocator
rounding included; each backend's CPU test measures it), and a layout fits when both do: the
GPU as above, the host within the budget the launcher gives each trainer rank (``host_bytes``:
what keeps the node's peak under :data:`HOST_CAP` of its memory once Ray, the launcher and
every process's runtime have theirs; ``rl_runtime.parallel.host_budget``). Such layouts are
tried only after every layout that keeps the state on the GPU, the smallest fraction first.
Colocated, where the trainer's state sits while the engine generates is planned against both
memories too (:func:`rl_runtime.colocation.plan_colocation`): what the trainer keeps then is the backend's
``resident_bytes`` where it has one (FSDP frees its gradients before the engine resumes:
weights and optimizer state stay), else its weights, gradients and optimizer state
(:attr:`MemoryEstimate.resident`); the plan gives the engine's KV cache a size in tokens
(``ColocationPlan.kv_cache_tokens``), which the transformers engine takes as
``cache_tokens`` and checks against the memory free when it allocates."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rl_algos.run_context import ModelShape, ParallelLayout, StateBytes, TrainLayout
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import TrainerConfig

__all__ = [
    "HOST_CAP",
    "HOST_RESERVE_BYTES",
    "OFFLOAD_FRACTIONS",
    "PROCESS_HOST_BYTES",
    "RESERVE_BYTES",
    "GiB",
    "MemoryEstimate",
    "ModelShape",
    "TrainLayout",
    "candidate_layouts",
    "check_layout",
    "choose_layout",
    "describe",
    "estimate_memory",
    "flags",
]

GiB = 1 << 30
RESERVE_BYTES = 3 * GiB
#: The share of a node's memory the plan lets everything on it take at its peak. Ray's memory
#: monitor kills a worker once the node's used memory passes 95 % (``RAY_memory_usage_threshold``'s
#: default), as it killed the 8B trainers on the H200 (2026-12-04); the ten points between are
#: the estimate's margin.
HOST_CAP = 0.85
#: What a node holds besides its trainer ranks and engines: the launcher, Ray's own processes,
#: the page cache Ray counts as used. About 14.5 GiB on the H200 (2026-12-04, the 8B on FSDP).
HOST_RESERVE_BYTES = 15 * GiB
#: Host memory of one GPU process beside its state: Python, torch, the CUDA runtime's host
#: side, compiled code. The 8B FSDP trainer held 5.2 GiB beyond its host masters once loaded
#: (H200, 2026-12-04: 31.3 GiB resident, 26.1 of masters); counted for each trainer rank and
#: each engine process on the node.
PROCESS_HOST_BYTES = 5 * GiB
#: Fractions of the optimizer state on the host a layout chooser tries, smallest first.
OFFLOAD_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))
PARTS = ("weights", "gradients", "optimizer", "activations", "logits", "reserve")


def describe(trainer: TrainerConfig, layout: TrainLayout) -> str:
    """One line: the backend's split (its own words), recompute and the token budget."""
    parts = trainer.describe_layout(layout)
    parts.append("recompute" if layout.recomputes else "no recompute")
    offload = layout.parallel.optimizer_offload
    if offload > 0:
        parts.append(f"optimizer {offload:.0%} on the host")
    tokens = f", {layout.max_tokens_per_gpu} tokens per micro-batch"
    if layout.tokens_per_gpu > layout.max_tokens_per_gpu:  # a longer sample: its own micro-batch
        tokens += f" ({layout.tokens_per_gpu} per GPU for the longest sample)"
    return ", ".join(parts) + tokens


def flags(trainer: TrainerConfig, layout: TrainLayout) -> str:
    """The launcher flags that select this backend and layout."""
    out = trainer.layout_flags(layout)
    out += ["--gradient-checkpointing"] * layout.recomputes
    offload = layout.parallel.optimizer_offload
    if offload > 0:
        out.append(f"--optimizer-cpu-offload --optimizer-offload-fraction {offload:g}")
    out.append(f"--max-tokens-per-gpu {layout.max_tokens_per_gpu}")
    return " ".join(out)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part, of the layout ``description`` names."""

    description: str
    weights: float
    gradients: float
    optimizer: float  # float32 masters and AdamW moments
    activations: float
    logits: float
    reserve: float = RESERVE_BYTES
    host: float = 0.0  # host memory per trainer rank (the offloaded optimizer state), not in total
    # what the trainer keeps on the GPU while a colocated engine generates (the backend's
    # ``resident_bytes``); None: weights, gradients and optimizer state (see ``resident``)
    kept: float | None = None

    @property
    def resident(self) -> float:
        """Bytes the trainer keeps on the GPU between steps, while a colocated engine
        generates: the backend's answer, else weights, gradients and optimizer state."""
        if self.kept is not None:
            return self.kept
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.reserve
        )

    def breakdown(self) -> str:
        out = ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in PARTS)
        return out + (f"; on the host {self.host / GiB:.1f}" if self.host else "")

    def fits(self, gpu_bytes: float, host_bytes: float | None = None) -> bool:
        """Within the GPU, and (given a per-rank budget) the host part within the host."""
        return self.total <= gpu_bytes and (host_bytes is None or self.host <= host_bytes)

    def to_dict(
        self, gpu_bytes: float | None = None, host_bytes: float | None = None
    ) -> dict[str, object]:
        """For ``--print-config``: the layout, the parts and the total in GiB, and the host
        memory each trainer rank needs (``host_gib``) against its budget."""
        out: dict[str, object] = {"description": self.description}
        for part in PARTS:
            out[f"{part}_gib"] = round(getattr(self, part) / GiB, 1)
        out["total_gib"] = round(self.total / GiB, 1)
        out["host_gib"] = round(self.host / GiB, 1)
        if gpu_bytes:
            out["gpu_gib"] = round(gpu_bytes / GiB, 1)
            out["fits"] = self.fits(gpu_bytes, host_bytes)
        if host_bytes is not None:
            out["host_budget_gib"] = round(host_bytes / GiB, 1)
        return out


def estimate_memory(
    shape: ModelShape,
    trainer: TrainerConfig,
    layout: TrainLayout,
    *,
    vision_patches_per_token: float = 0.25,
) -> MemoryEstimate:
    """Peak memory per GPU of a training step: the backend's parts and the reserve."""
    held: StateBytes = trainer.state_bytes(
        shape, layout, vision_patches_per_token=vision_patches_per_token
    )
    # optional on a backend (TrainerConfig): what it keeps while a colocated engine generates
    resident = getattr(trainer, "resident_bytes", None)
    kept = None if resident is None else resident(shape, layout)
    return MemoryEstimate(describe(trainer, layout), **dataclasses.asdict(held), kept=kept)


Candidate = tuple[TrainerConfig, TrainLayout]


def _variants(trainer: TrainerConfig, base: ParallelLayout, layout: TrainLayout) -> list[Candidate]:
    """``base`` with TP, sequence parallel, CP (only for a longest sample beyond the token
    budget) and recompute varied, where the world divides them and ``trainer`` runs them
    (the optimizer's offload kept)."""
    world, tokens, longest = layout.world_size, layout.max_tokens_per_gpu, layout.longest_sample
    out: list[Candidate] = []
    for cp in (1, 2, 4, 8):
        if cp > 1 and longest <= tokens:
            continue
        for tp in (1, 2, 4, 8):
            if world % (tp * cp * base.pp):
                continue
            for recompute in ("none", "full"):
                p = dataclasses.replace(base, tp=tp, sp=tp > 1, cp=cp, recompute=recompute)
                if trainer.supports(p, world) is None:
                    out.append((trainer, TrainLayout(world, tokens, p, longest)))
    return out


def _offloaded(candidates: list[Candidate], fractions: Sequence[float]) -> list[Candidate]:
    """``candidates`` with each of ``fractions`` of the optimizer on the host, by fraction,
    where the backend runs it."""
    out = []
    for f in fractions:
        for c, t in candidates:
            p = dataclasses.replace(t.parallel, optimizer_offload=f)
            if c.supports(p, t.world_size) is None:
                out.append((c, dataclasses.replace(t, parallel=p)))
    return out


def candidate_layouts(
    trainer: TrainerConfig,
    layout: TrainLayout,
    others: Sequence[TrainerConfig] = (),
    offloads: Sequence[float] = OFFLOAD_FRACTIONS,
) -> list[Candidate]:
    """Layouts to suggest instead of ``layout``, cheapest first: the same backend with more
    tensor parallelism and recomputation (its pipeline and expert split kept), then context
    parallelism for a longest sample beyond the token budget, then each of ``others`` (the
    other backends the app offers, in their default split), then each of these with
    ``offloads`` of the optimizer on the host, then fewer tokens."""
    ordered = _variants(trainer, layout.parallel, layout)
    for other in others:
        ordered += _variants(other, ParallelLayout(), layout)
    ordered += _offloaded(ordered, offloads)
    smaller = [
        (c, dataclasses.replace(t, max_tokens_per_gpu=layout.max_tokens_per_gpu // div))
        for div in (2, 4)
        for c, t in ordered
        if layout.max_tokens_per_gpu // div >= 1024
    ]
    return [(c, t) for c, t in ordered + smaller if not (c is trainer and t == layout)]


def choose_layout(
    shape: ModelShape,
    trainer: TrainerConfig,
    layout: TrainLayout,
    gpu_bytes: float,
    *,
    vary: bool = True,
    offloads: Sequence[float] = (),
    host_bytes: float | None = None,
) -> tuple[TrainLayout, MemoryEstimate]:
    """``layout`` when it fits, else the first layout of the same backend and tokens that does:
    with ``vary``, more tensor parallelism, then recomputation; then the same with each of
    ``offloads`` (fractions of the optimizer state on the host, within ``host_bytes`` per
    rank), in that order. None fits: the first that fits the GPU alone, whose host part is
    then what ``check_layout`` refuses, else ``layout``."""
    base = [layout]
    if vary:
        base += [
            t
            for c, t in _variants(trainer, layout.parallel, layout)
            if t != layout and c is trainer
        ]
    options = base + [t for _, t in _offloaded([(trainer, t) for t in base], offloads)]
    gpu_only = None
    for option in options:
        estimate = estimate_memory(shape, trainer, option)
        if estimate.fits(gpu_bytes, host_bytes):
            return option, estimate
        if gpu_only is None and estimate.fits(gpu_bytes):
            gpu_only = option, estimate
    return gpu_only or (layout, estimate_memory(shape, trainer, layout))


def check_layout(
    shape: ModelShape,
    trainer: TrainerConfig,
    layout: TrainLayout,
    gpu_bytes: float,
    *,
    others: Sequence[TrainerConfig] = (),
    model: str = "the model",
    host_bytes: float | None = None,
    gpu_note: str = "",
) -> MemoryEstimate:
    """The estimate when it fits in ``gpu_bytes`` (and its host part in ``host_bytes`` per
    rank); otherwise :class:`PreflightError` with the numbers and, for this backend and each
    of ``others``, the first candidate that fits. ``gpu_note``: how ``gpu_bytes`` came from the
    GPU's memory, for the message (" (141.0 less 3.0 a released engine keeps)")."""
    estimate = estimate_memory(shape, trainer, layout)
    if estimate.fits(gpu_bytes, host_bytes):
        return estimate
    params = (shape.language_params + shape.vision_params) / 1e9
    if estimate.total <= gpu_bytes:
        assert host_bytes is not None
        message = (
            f"{model} ({params:.2f}B parameters) as {estimate.description} needs about "
            f"{estimate.host / GiB:.1f} GiB of host memory per trainer rank for its optimizer "
            f"state there, beyond the {host_bytes / GiB:.1f} GiB each may take: the plan keeps "
            f"a node under {HOST_CAP:.0%} of its memory (--host-memory-gib) with Ray, the "
            "launcher and every process's runtime."
        )
    else:
        message = (
            f"{model} ({params:.2f}B parameters) does not fit in {gpu_bytes / GiB:.1f} GiB per "
            f"GPU{gpu_note} as {estimate.description}: about {estimate.total / GiB:.1f} GiB "
            f"({estimate.breakdown()})."
        )
    tries = []
    candidates = candidate_layouts(trainer, layout, others)
    for backend in (trainer, *others):
        for c, t in candidates:
            e = estimate_memory(shape, c, t)
            if c is backend and e.fits(gpu_bytes, host_bytes):
                host = f", {e.host / GiB:.1f} GiB on the host" if e.host else ""
                tries.append(f"{flags(c, t)} (about {e.total / GiB:.1f} GiB{host})")
                break
    if tries:
        message += " Try " + ", or ".join(tries) + "."
    elif estimate.total <= gpu_bytes:  # the host is short whatever part of it moves there
        message += (
            " No --optimizer-offload-fraction fits both the GPU and the host: use more GPUs "
            "(--num-gpus), or a node with more memory."
        )
    else:
        message += " No layout on this many GPUs fits: use more GPUs (--num-gpus)."
    raise PreflightError(message)
