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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rl_algos.run_context import ModelShape, ParallelLayout, StateBytes, TrainLayout
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import TrainerConfig

__all__ = [
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
    "keep_train_state_on_gpu",
]

GiB = 1 << 30
RESERVE_BYTES = 3 * GiB
PARTS = ("weights", "gradients", "optimizer", "activations", "logits", "reserve")


def describe(trainer: TrainerConfig, layout: TrainLayout) -> str:
    """One line: the backend's split (its own words), recompute and the token budget."""
    parts = trainer.describe_layout(layout)
    parts.append("recompute" if layout.recomputes else "no recompute")
    tokens = f", {layout.max_tokens_per_gpu} tokens per micro-batch"
    if layout.tokens_per_gpu > layout.max_tokens_per_gpu:  # a longer sample: its own micro-batch
        tokens += f" ({layout.tokens_per_gpu} per GPU for the longest sample)"
    return ", ".join(parts) + tokens


def flags(trainer: TrainerConfig, layout: TrainLayout) -> str:
    """The launcher flags that select this backend and layout."""
    out = trainer.layout_flags(layout)
    out += ["--gradient-checkpointing"] * layout.recomputes
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
        return ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in PARTS)

    def to_dict(self, gpu_bytes: float | None = None) -> dict[str, object]:
        """For ``--print-config``: the layout, the parts and the total in GiB."""
        out: dict[str, object] = {"description": self.description}
        for part in PARTS:
            out[f"{part}_gib"] = round(getattr(self, part) / GiB, 1)
        out["total_gib"] = round(self.total / GiB, 1)
        if gpu_bytes:
            out["gpu_gib"] = round(gpu_bytes / GiB, 1)
            out["fits"] = self.total <= gpu_bytes
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
    return MemoryEstimate(describe(trainer, layout), **dataclasses.asdict(held))


Candidate = tuple[TrainerConfig, TrainLayout]


def _variants(trainer: TrainerConfig, base: ParallelLayout, layout: TrainLayout) -> list[Candidate]:
    """``base`` with TP, sequence parallel, CP (only for a longest sample beyond the token
    budget) and recompute varied, where the world divides them and ``trainer`` runs them."""
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
                if trainer.supports(p) is None:
                    out.append((trainer, TrainLayout(world, tokens, p, longest)))
    return out


def candidate_layouts(
    trainer: TrainerConfig, layout: TrainLayout, others: Sequence[TrainerConfig] = ()
) -> list[Candidate]:
    """Layouts to suggest instead of ``layout``, cheapest first: the same backend with more
    tensor parallelism and recomputation (its pipeline and expert split kept), then context
    parallelism for a longest sample beyond the token budget, then each of ``others`` (the
    other backends the app offers, in their default split), then fewer tokens."""
    ordered = _variants(trainer, layout.parallel, layout)
    for other in others:
        ordered += _variants(other, ParallelLayout(), layout)
    smaller = [
        (c, dataclasses.replace(t, max_tokens_per_gpu=layout.max_tokens_per_gpu // div))
        for div in (2, 4)
        for c, t in ordered
        if layout.max_tokens_per_gpu // div >= 1024
    ]
    return [(c, t) for c, t in ordered + smaller if not (c is trainer and t == layout)]


def choose_layout(
    shape: ModelShape, trainer: TrainerConfig, layout: TrainLayout, gpu_bytes: float
) -> tuple[TrainLayout, MemoryEstimate]:
    """``layout`` when it fits, else the first layout of the same backend and tokens that does
    (more tensor parallelism, then recomputation), else ``layout`` (``check_layout`` refuses)."""
    options = [layout] + [
        t
        for c, t in candidate_layouts(trainer, layout)
        if c is trainer and t.max_tokens_per_gpu == layout.max_tokens_per_gpu
    ]
    for option in options:
        estimate = estimate_memory(shape, trainer, option)
        if estimate.total <= gpu_bytes:
            return option, estimate
    return layout, estimate_memory(shape, trainer, layout)


def check_layout(
    shape: ModelShape,
    trainer: TrainerConfig,
    layout: TrainLayout,
    gpu_bytes: float,
    *,
    others: Sequence[TrainerConfig] = (),
    model: str = "the model",
) -> MemoryEstimate:
    """The estimate when it fits in ``gpu_bytes``; otherwise :class:`PreflightError` with the
    numbers and, for this backend and each of ``others``, the first candidate that fits."""
    estimate = estimate_memory(shape, trainer, layout)
    if estimate.total <= gpu_bytes:
        return estimate
    params = (shape.language_params + shape.vision_params) / 1e9
    message = (
        f"{model} ({params:.2f}B parameters) does not fit in {gpu_bytes / GiB:.1f} GiB per GPU "
        f"as {estimate.description}: about {estimate.total / GiB:.1f} GiB "
        f"({estimate.breakdown()})."
    )
    tries = []
    candidates = candidate_layouts(trainer, layout, others)
    for backend in (trainer, *others):
        for c, t in candidates:
            if c is backend and (e := estimate_memory(shape, c, t)).total <= gpu_bytes:
                tries.append(f"{flags(c, t)} (about {e.total / GiB:.1f} GiB)")
                break
    if tries:
        message += " Try " + ", or ".join(tries) + "."
    else:
        message += " No layout on this many GPUs fits: use more GPUs (--num-gpus)."
    raise PreflightError(message)


def keep_train_state_on_gpu(
    shape: ModelShape,
    estimate: MemoryEstimate,
    *,
    gpu_bytes: float,
    engine_sequences: int,
    tokens_per_sequence: int,
    engine_share: float,
) -> tuple[bool, str]:
    """Colocated: may the trainer's weights, gradients and optimizer state stay on the GPU while
    the engine generates? Yes when the engine, sizing its KV cache as ``engine_share`` of the
    memory left beside them (the HF engine's ``kv_cache_fraction`` of free memory), still holds
    ``engine_sequences`` sequences of ``tokens_per_sequence`` tokens: then the onload and
    offload copies of every step are waste. Returns the answer and its numbers (for the log)."""
    resident = estimate.weights + estimate.gradients + estimate.optimizer
    engine_weights = 2 * (shape.language_params + shape.vision_params)
    kv_need = engine_sequences * tokens_per_sequence * shape.kv_bytes_per_token
    left = gpu_bytes - resident - engine_weights - 2 * RESERVE_BYTES  # both processes' contexts
    kv_got = max(0.0, engine_share * left)
    keep = shape.kv_bytes_per_token > 0 and kv_got >= kv_need
    why = (
        f"trainer state {resident / GiB:.1f} GiB, engine weights {engine_weights / GiB:.1f}, "
        f"its KV cache {kv_got / GiB:.1f} GiB beside them for {kv_need / GiB:.1f} needed "
        f"({engine_sequences} x {tokens_per_sequence} tokens), of {gpu_bytes / GiB:.1f} GiB"
    )
    return keep, why
