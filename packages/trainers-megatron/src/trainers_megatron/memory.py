"""Per-GPU memory of a Megatron training step, for the launcher's layout check
(``MegatronConfig.state_bytes``; rl-runtime adds the reserve and compares with the GPU).

Per parameter held: bf16 weights (2) and gradients (2), and the float32 masters (4), reduced
float32 gradients (4: the DDP buffers) and AdamW's moments (8). The language model is split by
TP and PP (the vision tower is whole on every first-stage rank), routed experts by EP x expert
TP; the distributed optimizer (the default) shards the float32 state over the data-parallel
ranks (experts over the expert-data-parallel ranks), without it every rank holds it whole.

Activations are bf16, per decoder layer and token ``2 * (8 h + 4 I)`` bytes, split by TP under
sequence parallelism (without it norms and residuals stay whole); recomputation keeps each
layer's input. Pipeline parallelism does not cut them: under 1F1B the first stage keeps ``pp``
micro-batches in flight, each through ``1 / pp`` of the layers. The vision tower is not
recomputed. Context parallelism splits each packed row over ``cp`` ranks; each attention layer
also keeps the whole row's keys and values (split by TP), and the vision tower runs on every CP
rank over the whole row's images (Qwen3.5's gated-delta-net layers, which gather the whole row,
are not counted beyond that). The logits are bf16 plus a float32 copy in the vocab-parallel
cross entropy. Against the H200 run of issue 19 (2B shape, 8 x 1,024 tokens, one image patch
per token, one GPU, peak allocated): 69 GiB measured, 73.1 estimated.

With the optimizer offloaded (``layout.parallel.optimizer_offload`` = f: megatron-core's
HybridDeviceOptimizer under its precision-aware distributed optimizer) f of this rank's
optimizer shard lives on the host: float32 masters and moments (12 bytes per parameter,
pageable: the masters are float32 widenings of pinned bf16 copies, whose rounded blocks
trainers_megatron.optim drops from torch's host cache, and the throwaway first hybrid
optimizer, another float32 copy, is collected at build), and the host step's pieces
(trainer_core.host_memory: two float32 gradient and two bf16 weight buffers of up to 64M
elements, pinned); with megatron-core's own step (``pieces=False``, the actor's
``overlap_cpu_optimizer_d2h_h2d`` off) a pageable float32 copy of every offloaded gradient
instead (4). The rest keeps its float32 copy and moments on the GPU (12). The distributed
optimizer's own float32 masters are gone in that form, so nothing else changes on the GPU.
:func:`host_bytes` is that host part, or with ``on_cpu`` everything a rank holds between steps
when the CPU plays the device, as the tests run it (tests/test_host_memory.py measures it:
the estimate is within 10 % of the resident memory the actor adds).

Between steps, while a colocated engine generates, the plan counts the weights, gradients and
optimizer state above (``MemoryEstimate.resident``; this backend has no ``resident_bytes``).
The released actor keeps less (tests/test_resident.py walks it on the CPU): bf16 weights (2),
the float32 DDP gradient buffers (4, zeroed, kept) and the device part's float32 copies and
moments (12); megatron-core's bf16 gradients (2) live only inside the backward. Those 2 bytes a
parameter stay counted on purpose, as margin for what the allocator keeps reserved beside it:
on an H100 (2026-12-07) the Qwen3.5 4-layer cut's released actor held 32.1 GiB allocated and
37.1 reserved against this figure's 41.4 (on 2026-12-06, before its AdamW state was made at
build, 52.8); lowered by the 2 bytes (9 GiB) it would be below what stayed reserved. With a KL penalty the frozen reference
model (``reference_model``) is a second bf16 copy of the held parameters on the GPU, split as
the model is: 2 bytes a parameter more in the weights, at the step's peak and between steps."""

from __future__ import annotations

from rl_algos.run_context import (
    ModelShape,
    StateBytes,
    TrainLayout,
    decoder_activations,
    vision_activations,
)
from trainer_core.host_memory import host_step_bytes


def state_bytes(
    shape: ModelShape,
    layout: TrainLayout,
    *,
    distributed_optimizer: bool,
    vision_patches_per_token: float = 0.25,
    reference_model: bool = False,
    pieces: bool = True,
) -> StateBytes:
    """What one rank holds at the step's peak (see the module docstring)."""
    p = layout.parallel
    h, inter = shape.hidden_size, shape.intermediate_size
    tp = p.tp
    held, opt_held = _held(shape, layout, distributed_optimizer=distributed_optimizer)
    weights, gradients = 2 * held * (1 + reference_model), 2 * held + 4 * opt_held
    optimizer = 12 * opt_held * (1 - p.optimizer_offload)
    host = host_bytes(shape, layout, distributed_optimizer=distributed_optimizer, pieces=pieces)
    per_layer_token: float = 2 * (8 * h + 4 * inter)
    if p.sp:
        per_layer_token /= tp
    elif tp > 1:  # norms and residuals whole, attention and MLP inner parts split
        per_layer_token = 2 * (4 * h + (4 * h + 4 * inter) / tp)
    saved_token = 2 * h / (tp if p.sp else 1)
    tokens = layout.tokens_per_gpu
    activations = decoder_activations(
        shape, layout, per_layer_token=per_layer_token, saved_token=saved_token
    )
    activations += tokens * p.cp * shape.kv_bytes_per_token / tp if p.cp > 1 else 0
    activations += vision_activations(
        shape, layout, recompute=False, vision_patches_per_token=vision_patches_per_token
    )
    logits = tokens * shape.vocab_size / tp * (2 + 4)
    return StateBytes(weights, gradients, optimizer, activations, logits, host)


def _held(
    shape: ModelShape, layout: TrainLayout, *, distributed_optimizer: bool
) -> tuple[float, float]:
    """Parameters one rank holds, and those of its optimizer shard."""
    p = layout.parallel
    tp, pp, ep, etp = p.tp, p.pp, p.ep, layout.expert_tp
    dense = (shape.language_params - shape.expert_params) / (tp * pp) + shape.vision_params
    experts = shape.expert_params / (ep * etp * pp)
    if not distributed_optimizer:
        return dense + experts, dense + experts
    expert_dp = max(1, layout.world_size // (ep * etp * pp))  # experts over expert-DP ranks
    return dense + experts, dense / layout.dp + experts / expert_dp


def host_bytes(
    shape: ModelShape,
    layout: TrainLayout,
    *,
    distributed_optimizer: bool,
    on_cpu: bool = False,
    reference_model: bool = False,
    pieces: bool = True,
) -> float:
    """Host memory of one rank's trainer state between steps.

    On a GPU: the offloaded part of the optimizer shard, float32 masters and AdamW moments, and
    the host step's pieces (``pieces``) or megatron-core's float32 gradient copies. ``on_cpu``:
    also what a GPU would hold, as a one-rank actor holds it on the CPU: bf16 weights, the DDP
    buffers' float32 gradients, the float32 copies and moments of the rest (megatron-core's
    bf16 gradients live only inside the backward), and the reference model's bf16 copy."""
    held, opt_held = _held(shape, layout, distributed_optimizer=distributed_optimizer)
    offload = layout.parallel.optimizer_offload
    offloaded = opt_held * offload
    if not pieces:
        host = 16 * offloaded
    elif on_cpu:
        host = 12 * offloaded + host_step_bytes(offloaded, on_cpu=True)
    else:
        host = host_step_bytes(offloaded)
    if on_cpu:
        host += (2 * (1 + reference_model) + 4) * held + 12 * opt_held * (1 - offload)
    return host
