"""Will the training layout fit? Memory per GPU, estimated before anything starts.

Plain arithmetic on numbers the app passes in (rl-runtime imports no model or trainer code):
the model's shape (:class:`ModelShape`), the layout (:class:`TrainLayout`) and the GPU's memory.
The parts, per GPU, in bytes:

- training state per parameter held: bf16 weights (2) and gradients (2), float32 masters (4),
  float32 gradients (4: FSDP's reduce dtype; the flat masters' and Megatron's DDP buffers)
  and AdamW's two moments (8). FSDP shards all of it over the world (only the bf16 copies of
  the units being gathered are whole); ``replicate`` and one rank hold it whole. Megatron
  splits the language model by TP and PP (the vision tower is whole on every first-stage
  rank), routed experts by EP x expert TP (TP unless set), and its distributed optimizer (the
  default) shards the masters, moments and reduced float32 gradients over the data-parallel
  ranks (experts over the expert-data-parallel ranks); without it every rank holds them whole.
- activations of one micro-batch of ``max_tokens_per_gpu`` tokens (or of the longest sample,
  which a micro-batch holds whole, when that is longer), bf16: per decoder layer and
  token ``2 * (8 h + 4 I)`` bytes (norm, attention and gated-MLP inputs and outputs), split by
  TP under sequence parallelism; with recomputation only each layer's input (``2 h``) is kept,
  plus one layer being recomputed. Pipeline parallelism does not cut them: under 1F1B the first
  stage keeps ``pp`` micro-batches in flight, each through ``1 / pp`` of the layers. The vision tower's blocks are counted the same way for
  ``vision_patches_per_token`` patches per token (Megatron does not recompute them).
- logits of the micro-batch: bf16 and their gradient (FSDP, which chunks its float32 work);
  Megatron's are bf16 plus a float32 copy in its vocab-parallel cross entropy.
- Megatron context parallelism (CP) splits each packed row over ``cp`` ranks, which pack rows
  of ``cp x max_tokens_per_gpu`` tokens: decoder activations and logits are of the tokens per
  GPU, ``max(max_tokens_per_gpu, longest sample / cp)``; each attention layer also keeps the
  whole row's keys and values (``kv_bytes_per_token`` per token, split by TP), and the vision
  tower runs on every CP rank over the whole row's images. Qwen3.5's gated-delta-net layers,
  which gather the whole row, are not counted beyond that.
- a fixed reserve for the CUDA context, NCCL buffers and allocator fragmentation.

Against the H200 runs of issue 19 and docs/performance.md (2B shape, 8 x 1,024 tokens with one
image patch per token, one GPU; peak allocated, so without the reserve): FSDP's flat masters
57.7 GiB measured, 62.8 estimated without the float32 gradient that run did not allocate;
Megatron 69 GiB measured, 73.1 estimated. It is an estimate to refuse layouts that cannot work,
slightly on the safe side, not a promise that a layout will.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rl_runtime.preflight import PreflightError

GiB = 1 << 30
RESERVE_BYTES = 3 * GiB


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a model (MoE: ``intermediate_size`` is what one token
    passes through, ``language_params`` counts every expert)."""

    language_params: int
    vision_params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    vision_depth: int = 0
    expert_params: int = 0  # the part of language_params in routed experts (MoE)
    kv_bytes_per_token: int = 0  # bf16 keys and values of every attention layer (rollout)


@dataclass(frozen=True)
class TrainLayout:
    """How the trainer ranks hold the model."""

    backend: Literal["fsdp", "megatron"]
    world_size: int
    max_tokens_per_gpu: int
    tp: int = 1
    sp: bool = False
    recompute: bool = False
    replicate: bool = False  # fsdp: the whole model on every rank
    pp: int = 1  # megatron: pipeline stages
    ep: int = 1  # megatron: expert-parallel ranks (MoE)
    etp: int | None = None  # megatron: each expert's tensor-parallel split (None: tp)
    distributed_optimizer: bool = True  # megatron: masters and moments sharded over DP
    cp: int = 1  # megatron: context-parallel ranks, each holding 1 / cp of a packed row
    longest_sample: int = 0  # tokens of the longest sequence (0: not known)

    @property
    def dp(self) -> int:
        """Data-parallel replicas (megatron: ranks per replica are TP x CP x PP)."""
        return max(1, self.world_size // (self.tp * self.cp * self.pp))

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens of one micro-batch on one GPU: the budget, or the longest sample's share
        when it is longer (a sample is never split over micro-batches; CP splits it)."""
        return max(self.max_tokens_per_gpu, -(-self.longest_sample // self.cp))

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def describe(self) -> str:
        if self.backend == "megatron":
            parts = [f"megatron TP{self.tp}"] + [f"CP{self.cp}"] * (self.cp > 1)
            parts += [f"PP{self.pp}"] * (self.pp > 1)
            parts += [f"EP{self.ep}"] * (self.ep > 1) + [f"ETP{self.etp}"] * (self.etp is not None)
            parts += [f"DP{self.dp}"]
            parts += ["SP"] * self.sp + ["distributed optimizer"] * self.distributed_optimizer
        else:
            how = "replicated" if self.replicate or self.world_size == 1 else "sharded"
            parts = [f"fsdp {how} over {self.world_size} GPU(s)"]
        parts.append("recompute" if self.recompute else "no recompute")
        tokens = f", {self.max_tokens_per_gpu} tokens per micro-batch"
        if self.tokens_per_gpu > self.max_tokens_per_gpu:  # a longer sample: its own micro-batch
            tokens += f" ({self.tokens_per_gpu} per GPU for the longest sample)"
        return ", ".join(parts) + tokens

    def flags(self) -> str:
        """The launcher flags that select this layout."""
        out = [f"--backend {self.backend}"]
        if self.backend == "megatron":
            out.append(f"--tensor-parallel {self.tp}")
            out += ["--sequence-parallel"] * self.sp
            out += [f"--context-parallel {self.cp}"] * (self.cp > 1)
            out += [f"--pipeline-parallel {self.pp}"] * (self.pp > 1)
            out += [f"--expert-parallel {self.ep}"] * (self.ep > 1)
            out += [f"--expert-tensor-parallel {self.etp}"] * (self.etp is not None)
            out += ["--no-distributed-optimizer"] * (not self.distributed_optimizer)
        elif self.replicate:
            out.append("--fsdp-replicate")
        out += ["--gradient-checkpointing"] * self.recompute
        out.append(f"--max-tokens-per-gpu {self.max_tokens_per_gpu}")
        return " ".join(out)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part."""

    layout: TrainLayout
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
        parts = ("weights", "gradients", "optimizer", "activations", "logits", "reserve")
        return ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in parts)

    def to_dict(self, gpu_bytes: float | None = None) -> dict[str, object]:
        """For ``--print-config``: the layout, the parts and the total in GiB."""
        out: dict[str, object] = {"description": self.layout.describe()}
        for part in ("weights", "gradients", "optimizer", "activations", "logits", "reserve"):
            out[f"{part}_gib"] = round(getattr(self, part) / GiB, 1)
        out["total_gib"] = round(self.total / GiB, 1)
        if gpu_bytes:
            out["gpu_gib"] = round(gpu_bytes / GiB, 1)
            out["fits"] = self.total <= gpu_bytes
        return out


def estimate_memory(
    shape: ModelShape, layout: TrainLayout, *, vision_patches_per_token: float = 0.25
) -> MemoryEstimate:
    """Peak memory per GPU of a training step (see the module docstring for the model)."""
    tokens = layout.tokens_per_gpu
    h, inter, layers = shape.hidden_size, shape.intermediate_size, shape.num_layers
    total_params = shape.language_params + shape.vision_params
    per_layer_token = 2 * (8 * h + 4 * inter)  # bf16 activations of a decoder layer, per token
    if layout.backend == "megatron":
        tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.expert_tp
        dense = (shape.language_params - shape.expert_params) / (tp * pp) + shape.vision_params
        experts = shape.expert_params / (ep * etp * pp)
        held = dense + experts
        if layout.distributed_optimizer:  # experts over the expert-data-parallel ranks
            expert_dp = max(1, layout.world_size // (ep * etp * pp))
            opt_held = dense / layout.dp + experts / expert_dp
        else:
            opt_held = held
        weights, gradients = 2 * held, 2 * held + 4 * opt_held
        optimizer = 12 * opt_held
        if layout.sp:
            per_layer_token /= tp
        elif tp > 1:  # norms and residuals whole, attention and MLP inner parts split
            per_layer_token = 2 * (4 * h + (4 * h + 4 * inter) / tp)
        saved_token = 2 * h / (tp if layout.sp else 1)
        logits = tokens * shape.vocab_size / tp * (2 + 4)
        vision_recompute = False
        gathered_kv = tokens * layout.cp * shape.kv_bytes_per_token / tp if layout.cp > 1 else 0
    else:
        shards = 1 if layout.replicate else max(1, layout.world_size)
        weights = 2 * total_params / shards
        gradients = 6 * total_params / shards  # bf16, and float32 for the masters / reduce
        optimizer = 12 * total_params / shards
        if shards > 1:  # the gathered bf16 units: a decoder layer, the next one, the embedding
            unit = shape.language_params / max(1, layers)
            weights += 2 * (2 * unit + shape.vocab_size * h)
        saved_token = 2 * h
        logits = tokens * shape.vocab_size * (2 + 2)
        vision_recompute = layout.recompute
        gathered_kv = 0
    if layout.recompute:
        activations = tokens * (layers * saved_token + per_layer_token)
    else:
        activations = tokens * layers * per_layer_token
    activations += gathered_kv
    d, vi = shape.vision_hidden_size, shape.vision_intermediate_size
    patches = tokens * layout.cp * vision_patches_per_token  # every CP rank: the whole row
    per_block_patch = 2 * (8 * d + 4 * vi)
    if vision_recompute:
        activations += patches * (shape.vision_depth * 2 * d + per_block_patch)
    else:
        activations += patches * shape.vision_depth * per_block_patch
    return MemoryEstimate(layout, weights, gradients, optimizer, activations, logits)


def candidate_layouts(layout: TrainLayout) -> list[TrainLayout]:
    """Layouts to suggest instead of ``layout``, cheapest first: the same backend with more
    tensor parallelism and recomputation, then (megatron, for a longest sample beyond the
    token budget) context parallelism, then the other backend, then fewer tokens."""
    world, same = layout.world_size, layout.backend
    # megatron: the requested pipeline / expert split and optimizer kept, TP and recompute varied
    base = layout if layout.backend == "megatron" else TrainLayout("megatron", world, 1)
    megatron = [
        dataclasses.replace(
            base,
            max_tokens_per_gpu=layout.max_tokens_per_gpu,
            tp=tp,
            sp=tp > 1,
            recompute=recompute,
            replicate=False,
            cp=cp,
            longest_sample=layout.longest_sample,
        )
        for cp in (1, 2, 4, 8)
        if cp == 1 or layout.longest_sample > layout.max_tokens_per_gpu
        for tp in (1, 2, 4, 8)
        if world % (tp * cp * base.pp) == 0
        for recompute in (False, True)
    ]
    fsdp = [
        TrainLayout(
            "fsdp",
            world,
            layout.max_tokens_per_gpu,
            recompute=recompute,
            longest_sample=layout.longest_sample,
        )
        for recompute in (False, True)
    ]
    ordered = megatron + fsdp if same == "megatron" else fsdp + megatron
    smaller = [
        dataclasses.replace(c, max_tokens_per_gpu=layout.max_tokens_per_gpu // div)
        for div in (2, 4)
        for c in ordered
        if layout.max_tokens_per_gpu // div >= 1024
    ]
    return [c for c in ordered + smaller if c != layout]


def choose_layout(
    shape: ModelShape, layout: TrainLayout, gpu_bytes: float
) -> tuple[TrainLayout, MemoryEstimate]:
    """``layout`` when it fits, else the first layout of the same backend and tokens that does
    (more tensor parallelism, then recomputation), else ``layout`` (``check_layout`` refuses)."""
    options = [layout] + [
        c
        for c in candidate_layouts(layout)
        if c.backend == layout.backend and c.max_tokens_per_gpu == layout.max_tokens_per_gpu
    ]
    for option in options:
        estimate = estimate_memory(shape, option)
        if estimate.total <= gpu_bytes:
            return option, estimate
    return layout, estimate_memory(shape, layout)


def check_layout(
    shape: ModelShape, layout: TrainLayout, gpu_bytes: float, *, model: str = "the model"
) -> MemoryEstimate:
    """The estimate when it fits in ``gpu_bytes``; otherwise :class:`PreflightError` with the
    numbers and the first candidate layout that fits."""
    estimate = estimate_memory(shape, layout)
    if estimate.total <= gpu_bytes:
        return estimate
    params = (shape.language_params + shape.vision_params) / 1e9
    message = (
        f"{model} ({params:.2f}B parameters) does not fit in {gpu_bytes / GiB:.1f} GiB per GPU "
        f"as {layout.describe()}: about {estimate.total / GiB:.1f} GiB ({estimate.breakdown()})."
    )
    tries = []
    for backend in dict.fromkeys((layout.backend, "megatron", "fsdp")):
        for c in candidate_layouts(layout):
            if c.backend == backend and (e := estimate_memory(shape, c)).total <= gpu_bytes:
                tries.append(f"{c.flags()} (about {e.total / GiB:.1f} GiB)")
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
