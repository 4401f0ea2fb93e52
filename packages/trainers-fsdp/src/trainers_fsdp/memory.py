"""Per-GPU memory of an FSDP training step, for the launcher's layout check
(``FsdpConfig.state_bytes``; rl-runtime adds the reserve and compares with the GPU).

Per parameter held: bf16 weights (2) and gradients (2), float32 gradients (4: the reduce
dtype; the flat masters' buffer on one rank), float32 masters (4) and AdamW's two moments (8).
FSDP shards all of it over the world; with ``replicate`` (or one rank) every rank holds it
whole. Sharded, the bf16 units being gathered are whole: a decoder layer, the next one, the
embedding. Activations are the decoder's (``rl_algos.run_context.decoder_activations``) with
whole-layer recomputation of the vision blocks too; the logits are bf16 with their gradient
(the float32 work is chunked). Against the H200 runs of issue 19 (2B shape, 8 x 1,024 tokens,
one image patch per token, one GPU, peak allocated): 57.7 GiB measured, 62.8 estimated without
the float32 gradient that run did not allocate.

With the optimizer offloaded (``layout.parallel.optimizer_offload`` = f, one rank or
``replicate``; trainer_core.host_adamw) f of the masters and moments (12 bytes per parameter)
move to the host, into page-locked buffers of their own size (``trainer_core.pinned_empty``),
with the host step's two pinned pieces of gradient and weights (float32 and bf16, taken from
torch's caching host allocator, which rounds each up to a power of two); sharded FSDP does not
offload, and is counted as without it. :func:`host_bytes` is that host part, or with
``on_cpu`` everything a rank holds between steps when the CPU plays the device, as the tests
run it (tests/test_host_memory.py measures it: the estimate is within 10 % of the resident
memory the actor adds).

Colocated, between steps, the trainer keeps less than at the step's peak: an optimizer step
leaves the gradients zero, and ``FsdpActor.release_cache`` (before the engine resumes) frees
them, the allocator's cache and whatever a push left there. :func:`resident_bytes` is what
stays, the part of the plan that the engine's KV cache is sized beside
(``rl_runtime.plan_colocation``); tests/test_resident.py counts every tensor a released actor
still holds against it.

With a KL penalty the actor also holds the frozen reference model (:func:`reference_bytes`). On
a GPU it lives on the host by default (``offload_reference``: FSDP2's offload, float32 shards
in page-locked memory, each unit copied in as the reference forward reaches it), which adds
host memory and nothing between steps on the GPU; kept on the GPU it is a bf16 cast on a whole
rank, float32 shards under FSDP2, at the step's peak and between steps."""

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
    replicate: bool,
    vision_patches_per_token: float = 0.25,
    reference: str | None = None,
) -> StateBytes:
    """What one rank holds at the step's peak (see the module docstring; ``reference``: the
    frozen reference model's placement, as :func:`reference_bytes` takes it)."""
    h, layers = shape.hidden_size, shape.num_layers
    total_params = shape.language_params + shape.vision_params
    shards = 1 if replicate else max(1, layout.world_size)
    ref_gpu, ref_host = reference_bytes(shape, layout, replicate=replicate, placement=reference)
    weights = 2 * total_params / shards + ref_gpu
    gradients = 6 * total_params / shards  # bf16, and float32 for the masters / reduce
    optimizer = 12 * total_params / shards * (1 - _offloaded(layout, shards))
    host = host_bytes(shape, layout, replicate=replicate) + ref_host
    if shards > 1:  # the gathered bf16 units: a decoder layer, the next one, the embedding
        unit = shape.language_params / max(1, layers)
        weights += 2 * (2 * unit + shape.vocab_size * h)
    per_layer_token = 2 * (8 * h + 4 * shape.intermediate_size)  # bf16, per token
    activations = decoder_activations(
        shape, layout, per_layer_token=per_layer_token, saved_token=2 * h
    )
    activations += vision_activations(
        shape,
        layout,
        recompute=layout.recomputes,
        vision_patches_per_token=vision_patches_per_token,
    )
    logits = layout.tokens_per_gpu * shape.vocab_size * (2 + 2)
    return StateBytes(weights, gradients, optimizer, activations, logits, host)


def _offloaded(layout: TrainLayout, shards: int) -> float:
    """The part of the optimizer state on the host: the layout's, where FSDP runs it (whole
    ranks only)."""
    return layout.parallel.optimizer_offload if shards == 1 else 0.0


def host_bytes(
    shape: ModelShape, layout: TrainLayout, *, replicate: bool, on_cpu: bool = False
) -> float:
    """Host memory of one rank's trainer state between steps.

    On a GPU: the offloaded part of the optimizer, float32 masters and AdamW moments (12 bytes
    per parameter), and the host step's pieces, a float32 gradient and a bf16 weight buffer of
    :data:`~trainer_core.host_memory.CHUNK` elements each (fewer for a smaller host part), two of each, pinned whole and
    rounded up to a power of two. ``on_cpu``: the whole state as a one-rank bf16 actor holds
    it on the CPU (masters and moments wherever the fraction puts them, bf16 weights and
    gradient, the float32 gradient a step of several micro-batches accumulates into), and of
    the pieces' unpinned buffers only what the pieces reach."""
    params = shape.language_params + shape.vision_params
    shards = 1 if replicate else max(1, layout.world_size)
    offloaded = params / shards * _offloaded(layout, shards)
    if on_cpu:
        state = 20 * params / shards  # weights 2, gradients 2 + 4, masters 4, moments 8
        return state + host_step_bytes(offloaded, on_cpu=True)
    return host_step_bytes(offloaded)


def reference_bytes(
    shape: ModelShape, layout: TrainLayout, *, replicate: bool, placement: str | None
) -> tuple[float, float]:
    """GPU and host bytes of one rank's frozen reference model. ``placement``: None (no
    reference), ``"host"`` (FSDP2's CPU offload: float32 shards on the host), ``"whole"`` (a
    world of one without FSDP: a bf16 cast on the GPU) or ``"sharded"`` (FSDP2 on the GPU:
    float32 shards; its bf16 units exist only inside the reference forward)."""
    params = shape.language_params + shape.vision_params
    shards = 1 if replicate else max(1, layout.world_size)
    if placement is None:
        return 0.0, 0.0
    if placement == "host":
        return 0.0, 4 * params / shards
    if placement == "whole":
        return 2 * params, 0.0
    if placement == "sharded":
        return 4 * params / shards, 0.0
    raise ValueError(f"reference placement {placement!r}: host, whole or sharded")


def resident_bytes(
    shape: ModelShape,
    layout: TrainLayout,
    *,
    replicate: bool,
    fsdp_one_rank: bool = False,
    reference: str | None = None,
) -> float:
    """What one rank keeps on the GPU while a colocated engine generates, once the actor's
    ``release_cache`` has run: the weights and the optimizer state on the GPU, no gradients
    and no activations. Whole ranks (one, or ``replicate``): bf16 weights (2 bytes a
    parameter) over float32 masters and AdamW moments (12), less the optimizer's part on the
    host. Sharded FSDP2 (or ``fsdp_one_rank``, ``FsdpConfig.shard_single_rank``): the float32
    shard is the master (4 / N) beside the moments (8 / N); its bf16 copies live only inside a
    step."""
    params = shape.language_params + shape.vision_params
    shards = 1 if replicate else max(1, layout.world_size)
    ref_gpu, _ = reference_bytes(shape, layout, replicate=replicate, placement=reference)
    if shards == 1 and not fsdp_one_rank:
        return 2 * params + 12 * params * (1 - _offloaded(layout, shards)) + ref_gpu
    return 12 * params / shards + ref_gpu
