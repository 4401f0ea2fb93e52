"""What the Megatron actor keeps on its device while a colocated engine generates, against the plan.

Colocated, the trainer's state may stay on the GPU during rollout, and the engine's KV cache is
sized beside what the plan says the trainer keeps (``rl_runtime.memory.MemoryEstimate.resident``:
for this backend its weights, gradients and optimizer state, ``trainers_megatron.memory``).
On an H100 the Qwen3.5-35B-A3B 4-layer cut's trainer held 52.8 GiB there against a plan of
41.4 (docs/benchmarks/2026-12-06-qwen35-e2e-h100.md). These tests take a tiny real actor of
each family on the CPU through a step of two micro-batches and its release (``release_cache``,
which the loop calls before the engine resumes), then walk every object the actor references
and count each tensor storage once (``trainer_core.held``): what is left, less the parts that
live on the host by design (megatron-core's HybridDeviceOptimizer's float32 masters and their
AdamW state, and the pinned pieces its host step reads and writes through, or the gradient
copies of megatron-core's own host step), is what a GPU would keep.

What that is, per parameter: bf16 weights (2, megatron-core's DDP parameter buffer), float32
gradients (4, its gradient buffer, kept between steps and zeroed) and the float32 copies and
AdamW moments of the part the device steps (12 a parameter of it). The plan also counts the
bf16 gradients (2), which live only inside the backward: kept in the plan on purpose (see
``trainers_megatron.memory``). Nothing else stays: every storage the released actor keeps
existed once it was built (the AdamW state is made then, not by the first step, so that on a
GPU it never lands inside the segments of a step's freed activations, which ``empty_cache``
cannot give back while it lives there), and the MoE dispatchers' per-token tensors of the last
forward are dropped at the release.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos.optimizer import OptimConfig
from rl_algos.run_context import ModelShape, ParallelLayout, TrainLayout
from trainer_core.held import held_storages, pinned_free_bytes, storage_ptrs
from trainers_fsdp.synthetic import TINY_OVERRIDES, synthetic_batch
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor
from trainers_megatron.optim import adam_optimizers, hybrid_optimizer, optimizers
from vlm_models.presets import PRESETS
from vlm_models.sources import model_shape

FAMILIES = ["qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"]
FAMILIES = [p for p in FAMILIES if p in PRESETS]
MOE = [p for p in FAMILIES if "moe" in p]
TOKENS = 24  # per micro-batch: the small batch (24, 10, 14 tokens) takes two
pytestmark = pytest.mark.usefixtures("one_process")


def make_actor(preset: str, **options) -> MegatronActor:
    settings = dict(
        model=preset,
        model_overrides=dict(TINY_OVERRIDES),
        param_dtype="bfloat16",
        max_tokens_per_gpu=TOKENS,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        seed=0,
    )
    return MegatronActor(MegatronConfig(**(settings | options)))


def step(actor: MegatronActor, batch=None):
    """One GRPO step of two micro-batches over the small batch (made for ``actor`` when None,
    its old log-probs the actor's); the batch."""
    if batch is None:
        batch = synthetic_batch(actor.hf_config, [24, 10, 14], image_patches=[(4, 4), None, (2, 2)])
        batch.old_logprobs = actor.compute_logprobs(batch)
    assert actor.train_step(batch, loss="grpo")["num_micro_batches"] == 2
    return batch


def host_side(actor: MegatronActor) -> set[int]:
    """Storages that live on the host by design, wherever the device is: the hybrid
    optimizer's float32 masters and its host AdamW state, the host step's pieces (or
    megatron-core's gradient copies), and the offload's reused host buffers."""
    tensors = list(actor._offload._host.values())
    if actor._step.host_adamw is not None:
        tensors += actor._step.host_adamw._grads + actor._step.host_adamw._weights
    for opt in optimizers(actor.optimizer):
        hybrid = hybrid_optimizer(opt)
        if hybrid is None:
            continue
        tensors += [*hybrid.cpu_copys_map_gpu_param, *hybrid.cpu_copy_map_grad.values()]
        for sub in hybrid.cpu_optimizers:
            tensors += [v for s in sub.state.values() for v in s.values() if torch.is_tensor(v)]
    return storage_ptrs(tensors)


def on_device(actor: MegatronActor) -> dict[int, int]:
    """Bytes of each storage the actor references on its device, less what lives on the host
    by design, by address."""
    host = host_side(actor)
    held = held_storages(actor).items()
    return {p: n for p, (n, where) in held if where == actor.device.type and p not in host}


def unmoved(actor: MegatronActor, held: dict[int, int]) -> int:
    """Bytes of ``held`` that an offload (``_device_tensors``) leaves where they are: a few
    constants (megatron-core's 4-byte ``_scale_one``, its MoE dispatchers' expert orders, 8
    bytes an expert)."""
    moved = storage_ptrs(actor._device_tensors())
    return sum(n for p, n in held.items() if p not in moved)


def planned(actor: MegatronActor) -> float:
    """The plan's figure for this model and layout, as the colocation plan takes it
    (``MemoryEstimate.resident``), from the model's config as the launcher reads it."""
    from rl_runtime.memory import estimate_memory

    shape = ModelShape(**model_shape(actor.hf_config))
    layout = TrainLayout(
        1, TOKENS, ParallelLayout(optimizer_offload=actor.config.optimizer_offload)
    )
    return estimate_memory(shape, actor.config, layout).resident


def models(actor: MegatronActor) -> list[torch.nn.Module]:
    """The policy, and the reference model where the actor has one."""
    return [m for m in (actor.module, actor.ref_model) if m is not None]


def offloaded(actor: MegatronActor) -> int:
    """Parameters whose float32 copy and moments live on the host."""
    hybrids = [hybrid_optimizer(opt) for opt in optimizers(actor.optimizer)]
    return sum(p.numel() for h in hybrids if h is not None for p in h.cpu_copys_map_gpu_param)


@pytest.mark.parametrize(
    ("preset", "offload", "reference"),
    [(p, 0.5, False) for p in FAMILIES]
    + [("qwen3-vl-tiny", 0.0, False)]  # 0: flat masters on the device
    + [("qwen3-vl-moe-tiny", 0.5, True)],  # a KL penalty's frozen reference model beside
)
def test_the_plan_counts_every_tensor_a_released_actor_keeps(preset, offload, reference):
    """After a step of two micro-batches and ``release_cache``, the storages the actor still
    references on its device are bf16 weights, float32 gradients and the device part's
    float32 copies and moments: the plan less the bf16 gradients it counts (2 bytes a
    parameter, not held between steps). The difference allowed is what the formula leaves out
    by design, each taken from the model: the host part ends on the first parameter boundary
    past its fraction (12 bytes a parameter off it: taken exactly), megatron-core's padding of
    each parameter in its buffers (6 bytes an element, 10 with flat masters), the step counts
    and the model's buffers, and the config's parameter count against the built model's
    (Qwen3.5's differs by a few hundred, 20 bytes each). A gradient kept (2 to 4 bytes a
    parameter) is far beyond all of them.

    Every storage kept existed when the actor was built (nothing the step makes stays, so on
    a GPU nothing persistent lands in a step's freed blocks), and an offload moves them all
    (``_device_tensors``), before a step as after. A reference model (``reference_model``, a
    KL penalty's) is a second bf16 copy of the weights, in the plan too."""
    actor = make_actor(preset, optimizer_offload=offload, reference_model=reference)
    built = on_device(actor)
    assert unmoved(actor, built) <= 1024  # an offload before the first step moves everything
    step(actor)
    actor.release_cache()
    gc.collect()
    kept = on_device(actor)
    made_by_the_step = {p: n for p, n in kept.items() if built.get(p) != n}
    assert not made_by_the_step
    assert unmoved(actor, kept) <= 1024

    params = list(actor.module.parameters())
    counted = sum(p.numel() for p in params)
    buffers = list(actor.model.buffers) + list(actor.model.expert_parallel_buffers)
    padding = sum(b.grad_data.numel() for b in buffers) - counted
    shape = model_shape(actor.hf_config)
    split = offloaded(actor) - offload * counted
    expected = planned(actor) - 2 * counted - 12 * split
    steps = sum(len(inner.state) for inner in adam_optimizers(actor.optimizer))
    slack = (
        (10 if offload == 0 else 6) * padding
        + 4 * (steps + 8)  # float32 step counts and a few scalars (the clip's scale)
        + sum(b.numel() * b.element_size() for m in models(actor) for b in m.buffers())
        + 1024 * reference  # its MoE dispatchers' constants, as ``unmoved`` bounds the policy's
        + 20 * abs(shape["language_params"] + shape["vision_params"] - counted)
    )
    got = sum(kept.values())
    assert abs(got - expected) <= slack, (got, expected, slack)
    assert slack < 2 * counted / 4  # far below the gradients' 2 bytes a parameter


@pytest.mark.parametrize("preset", MOE)
def test_release_cache_drops_the_dispatchers_per_token_tensors(preset):
    """The MoE token dispatchers keep the router's probabilities and routing map
    (``[tokens, experts]``) and the permutation of the last forward until the next one: the
    release drops them (what megatron-core's ``cudagraph_attrs`` name, and the probabilities),
    in the reference model too."""
    actor = make_actor(preset, reference_model=True)
    batch = step(actor)
    actor.compute_logprobs(batch, reference=True)

    def left() -> list[str]:
        return [
            f"{name}.token_dispatcher.{attr}"
            for model in (actor.module, actor.ref_model)
            for name, m in model.named_modules()
            if (d := getattr(m, "token_dispatcher", None)) is not None
            for attr, value in vars(d).items()
            if torch.is_tensor(value) and not attr.endswith("by_local_experts")  # constants
        ]

    assert left()  # what the last forwards left
    actor.release_cache()
    assert left() == []


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_training_after_a_release_is_unchanged(offload):
    """Two steps with a release between, from AdamW state made at the build, give the same
    weights, bit for bit, as two steps without a release from state torch's AdamW makes at
    its first step."""
    preset = MOE[-1]
    runs = []
    for release in (False, True):
        actor = make_actor(preset, optimizer_offload=offload)
        if not release:  # torch's own lazy state, as before the actor made it at build
            for inner in adam_optimizers(actor.optimizer):
                assert inner.state
                inner.state.clear()
        batch = step(actor)
        if release:
            actor.release_cache()
        step(actor, batch)
        runs.append({n: p.detach().clone() for n, p in actor.module.named_parameters()})
    assert runs[0].keys() == runs[1].keys()
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def test_on_the_gpu_the_release_leaves_the_referenced_state_and_no_cache(preset):
    """On CUDA, after a step and its release: the allocator keeps no segment that a live
    block pins with free space around it (what ``empty_cache`` cannot give back), and what is
    allocated is what the actor references (and cuBLAS's workspaces): the CPU's walk above is
    what the GPU holds."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # what earlier tests in this process left
    actor = make_actor(preset, optimizer_offload=0.5)
    step(actor)
    actor.release_cache()
    gc.collect()
    kept = sum(on_device(actor).values())
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    # cached beside live blocks: only in the allocator's shared segments (small tensors
    # of 2 and 20 MiB segments: 17-20 MiB of them on an H100, 2026-12-07), none in a larger
    # one, where a kept tensor would pin a step's freed activations
    assert pinned_free_bytes() <= 2 << 20, (allocated, reserved)
    assert reserved - allocated <= 64 << 20, (allocated, reserved)
    assert 0 <= allocated - before - kept <= 256 << 20, (allocated, before, kept)
