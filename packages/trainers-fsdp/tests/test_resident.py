"""What the actor keeps on its device while a colocated engine generates, against the plan.

Colocated with the transformers engine, the trainer's state may stay on the GPU during rollout;
the engine's KV cache is then sized beside what the plan says the trainer keeps
(``FsdpConfig.resident_bytes``, ``rl_runtime.plan_colocation``). Whatever the trainer keeps
beyond it shrinks the cache: on an H200 the Qwen3.5-35B-A3B 8-layer cut's engine was left a
1-token cache. These tests take a tiny real actor of each family on the CPU through a step and
its release (``release_cache``, which the loop calls before the engine resumes), then walk every
object the actor references and count each tensor storage once: what is left, less the parts
that live on the host by design (the offloaded optimizer's masters and moments, its step's and
the offload's pinned buffers), is what a GPU would keep, and must be the plan's figure.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rl_algos.run_context import ModelShape, ParallelLayout, TrainLayout
from trainer_core.held import device_bytes as held_device_bytes
from trainer_core.held import pinned_free_bytes, storage_ptrs
from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.flat_adamw import FlatAdamW
from vlm_models.sources import model_shape

FAMILIES = ["qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"]
TOKENS = 24  # per micro-batch: the small batch (24, 10, 14 tokens) takes two, so the float32
# gradient accumulator is made too


def host_side(actor: FsdpActor) -> set[int]:
    """Storages that live on the host by design, wherever the device is: the offloaded part of
    the masters and moments, the host step's pieces, the offload's reused host copies."""
    tensors = []
    masters, optimizer = actor._masters, actor.optimizer
    if masters is not None:
        tensors += [masters.host_master, *masters._host._host.values()]
    if isinstance(optimizer, FlatAdamW) and optimizer.is_flat:
        tensors += [optimizer.host_exp_avg, optimizer.host_exp_avg_sq]
        tensors += optimizer._host._host.values()
        if optimizer._host_step is not None:
            tensors += optimizer._host_step._grads + optimizer._host_step._weights
    return storage_ptrs(tensors)


def device_bytes(actor: FsdpActor) -> int:
    """Bytes the actor references on its device (``trainer_core.held``: each storage once),
    less what lives on the host by design."""
    return held_device_bytes(actor, actor.device, host=host_side(actor))


def stepped_actor(make_config, make_batch, preset: str, **kwargs) -> tuple[FsdpActor, object]:
    """A tiny ``preset`` actor after one step of two micro-batches, and its batch."""
    actor = FsdpActor(make_config(model=preset, max_tokens_per_gpu=TOKENS, **kwargs))
    batch = make_batch(preset)
    batch.old_logprobs = actor.compute_logprobs(batch)
    metrics = actor.train_step(batch, loss="grpo")
    assert metrics["num_micro_batches"] == 2
    return actor, batch


def planned(actor: FsdpActor) -> float:
    """The plan's figure for this model and layout, from the model's config as the launcher
    reads it (``vlm_models.sources.model_shape``)."""
    cfg = actor.config
    shape = ModelShape(**model_shape(actor.model.config))
    layout = TrainLayout(1, TOKENS, ParallelLayout(optimizer_offload=cfg.optimizer_offload))
    return cfg.resident_bytes(shape, layout)


@pytest.mark.parametrize(
    ("preset", "options"),
    [(p, dict(param_dtype="bfloat16", optimizer_offload=0.5)) for p in FAMILIES]
    + [
        ("qwen3-vl-tiny", dict(param_dtype="bfloat16")),  # the whole optimizer on the device
        ("qwen3-vl-tiny", dict(shard_single_rank=True)),  # FSDP2: float32 shards, no masters
        # a KL penalty's frozen reference, kept on the device: a bf16 cast on one rank, float32
        # shards under FSDP2 (a GPU run's default holds it on the host instead)
        (
            "qwen3-vl-tiny",
            dict(param_dtype="bfloat16", reference_model=True, offload_reference=False),
        ),
        (
            "qwen3-vl-tiny",
            dict(shard_single_rank=True, reference_model=True, offload_reference=False),
        ),
    ],
)
def test_the_plan_counts_every_tensor_a_released_actor_keeps(
    make_config, make_small_batch, preset, options
):
    """After a step of two micro-batches and ``release_cache``, the storages the actor still
    references on its device add up to ``FsdpConfig.resident_bytes``: weights and the
    optimizer's device part, no gradients. The difference allowed is what the formula leaves
    out by design, each taken from the model: the host part ends on the first parameter
    boundary past its fraction (12 bytes a parameter short of it), one float32 step count a
    parameter and a few 4-byte scalars (the clip's scale; a full-suite run
    found one more on the FSDP2 layout than an isolated one), the models' buffers (rotary frequencies), and the
    config's parameter count against the built model's (Qwen3.5's differs by a few hundred,
    14 bytes each). A gradient kept (2 to 6 bytes a parameter) is far beyond all of them."""
    actor, _ = stepped_actor(make_config, make_small_batch, preset, **options)
    try:
        actor.release_cache()
        gc.collect()
        kept, plan = device_bytes(actor), planned(actor)
        models = [m for m in (actor.model, actor.ref_model) if m is not None]
        params = list(actor.model.parameters())
        counted = sum(p.numel() for p in params)
        shape = model_shape(actor.model.config)
        masters, fraction = actor._masters, actor.config.optimizer_offload
        split = 0.0 if masters is None else masters.host_end - fraction * masters.num_trainable
        slack = (
            12 * abs(split)
            + sum(b.numel() * b.element_size() for m in models for b in m.buffers())
            + 4 * (len(params) + 8)  # float32 step counts and a few scalars (see above)
            + 14 * abs(shape["language_params"] + shape["vision_params"] - counted)
        )
        assert abs(kept - plan) <= slack, (kept, plan, slack)
        # and the gradients (6 bytes a parameter on one rank) are not among them
        assert slack < 6 * counted / 4
    finally:
        actor.close()


@pytest.mark.parametrize("preset", FAMILIES)
def test_release_cache_frees_the_gradients_and_every_view_of_them(
    make_config, make_small_batch, preset
):
    """Between steps the gradient buffers hold zeros: the release frees the flat bf16 and
    float32 ones, and nothing keeps them alive (the model's and the masters' ``.grad``, the
    optimizer's cached views for the norm)."""
    actor, _ = stepped_actor(
        make_config, make_small_batch, preset, param_dtype="bfloat16", optimizer_offload=0.5
    )
    try:
        masters = actor._masters
        assert masters is not None and masters.grad is not None
        buffers = [weakref.ref(masters.grad), weakref.ref(masters.compute_grad)]
        actor.release_cache()
        gc.collect()
        assert [ref() for ref in buffers] == [None, None]
        assert masters.grad is None and masters.compute_grad is None
        assert all(p.grad is None for p in actor.model.parameters())
        assert all(p.grad is None for p in masters.module.parameters())
    finally:
        actor.close()


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_training_after_a_release_is_unchanged(make_config, make_small_batch, offload):
    """Released gradients are made again by the next backward: two steps with a release
    between give the same weights, bit for bit, as without."""
    runs = []
    for release in (False, True):
        actor, batch = stepped_actor(
            make_config,
            make_small_batch,
            "qwen3.5-moe-tiny",
            param_dtype="bfloat16",
            optimizer_offload=offload,
        )
        try:
            if release:
                actor.release_cache()
            actor.train_step(batch, loss="grpo")
            runs.append(actor.full_parameters())
        finally:
            actor.close()
    assert runs[0].keys() == runs[1].keys()
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name


def test_an_accumulated_gradient_survives_release_cache(make_config, make_small_batch):
    """A gradient accumulated without its step (``forward_backward``) is kept: the release
    frees only buffers that hold nothing."""
    actor = FsdpActor(make_config(param_dtype="bfloat16", max_tokens_per_gpu=TOKENS))
    try:
        batch = make_small_batch("qwen3-vl-tiny")
        batch.old_logprobs = actor.compute_logprobs(batch)
        actor.forward_backward(batch, loss="grpo")
        before = actor.full_gradients()
        actor.release_cache()
        after = actor.full_gradients()
        assert before.keys() == after.keys() and before
        assert all(torch.equal(before[n], after[n]) for n in before)
    finally:
        actor.close()


def test_moving_the_optimizer_drops_its_views_of_the_old_gradient(make_config, make_small_batch):
    """An offload moves the masters and the optimizer state; the optimizer's cached views for
    the gradient norm must not keep the gradient buffer left behind on the device alive (they
    kept the float32 accumulator, 4 bytes a parameter, on the GPU through every rollout)."""
    actor = FsdpActor(
        make_config(param_dtype="bfloat16", max_tokens_per_gpu=TOKENS, flat_update=True)
    )
    try:
        batch = make_small_batch("qwen3-vl-tiny")
        batch.old_logprobs = actor.compute_logprobs(batch)
        actor.forward_backward(batch, loss="grpo")  # two micro-batches: the float32 gradient
        actor.finish_grads()  # the norm caches its views of that gradient
        masters = actor._masters
        assert masters is not None and isinstance(actor.optimizer, FlatAdamW)
        old = weakref.ref(masters.grad)
        masters.to(torch.device("cpu"), fill=False)  # new buffers, as an offload makes them
        actor.optimizer.to(torch.device("cpu"))
        gc.collect()
        assert old() is None
    finally:
        actor.close()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-vl-tiny", "qwen3.5-moe-tiny"])
def test_on_the_gpu_the_release_leaves_the_planned_state_and_no_cache(
    make_config, make_small_batch, preset
):
    """On CUDA, after a step and its release, and again after a push packed as the CUDA-IPC
    transport packs it: the allocator keeps no cached block for the engine to miss, what is
    allocated is what the actor references (and cuBLAS's workspaces), and that is the plan's
    figure."""
    from weight_sync.cuda_ipc import FlatBuffers

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # what earlier tests in this process left
    actor, _ = stepped_actor(
        make_config, make_small_batch, preset, device="cuda", optimizer_offload=0.5
    )
    try:
        actor.release_cache()
        gc.collect()
        kept = device_bytes(actor)
        after_step = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        buffers = FlatBuffers(torch.device("cuda"))
        for i, bucket in enumerate(actor.iter_hf_weights(1 << 16, device=None)):
            buffers.pack(bucket, i)
        buffers.free()
        actor.release_cache()
        after_push = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        # cached beside live blocks: only in the allocator's shared segments (small tensors in
        # 2 and 20 MiB segments: 17-20 MiB of them on an H100, 2026-12-07), none in a larger
        # one, where a kept tensor would pin a step's freed activations
        assert pinned_free_bytes() <= 2 << 20
        for allocated, reserved in (after_step, after_push):
            assert reserved - allocated <= 64 << 20, (allocated, reserved)
            # beyond the actor's tensors: the cuBLAS workspaces, within the plan's reserve
            assert 0 <= allocated - before - kept <= 256 << 20, (allocated, before, kept)
        assert abs(kept - planned(actor)) <= 0.05 * planned(actor)
    finally:
        actor.close()
