"""GPU-only behaviour: bf16 mixed precision and offload / onload (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from trainers_fsdp.actor import FsdpActor

pytestmark = pytest.mark.gpu


def test_offload_onload_roundtrip_on_gpu(make_config, batch):
    actor = FsdpActor(make_config(device="cuda"))
    actor.train_step(batch, loss="sft")  # optimizer state exists
    before = actor.compute_logprobs(batch)
    used = torch.cuda.memory_allocated()
    actor.offload()
    assert torch.cuda.memory_allocated() < used
    assert all(p.device.type == "cpu" for p in actor.model.parameters())
    with pytest.raises(RuntimeError, match="onload"):
        actor.compute_logprobs(batch)
    actor.onload()
    after = actor.compute_logprobs(batch)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b)
    assert actor.train_step(batch, loss="sft")["update_skipped"] == 0.0


def test_bf16_logprobs_close_to_fp32(make_config, batch):
    bf16 = FsdpActor(make_config(device="cuda")).compute_logprobs(batch)
    fp32 = FsdpActor(make_config(device="cuda", param_dtype="float32")).compute_logprobs(batch)
    for a, b in zip(bf16, fp32, strict=True):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("max_tokens", [64, 4096], ids=["micro-batches", "one micro-batch"])
def test_master_weights_on_gpu_match_fsdp(make_config, batch, max_tokens):
    """The one-rank master weights (compiled flat AdamW and bookkeeping passes on CUDA) train
    as FSDP does on one GPU, and leave the bf16 weights an exact cast of the masters."""
    kw = dict(device="cuda", compile=False, max_tokens_per_gpu=max_tokens)
    ours, fsdp = FsdpActor(make_config(**kw)), FsdpActor(make_config(shard_single_rank=True, **kw))
    assert ours.optimizer.is_flat  # the CUDA default
    got, ref = ours.train_step(batch, loss="sft"), fsdp.train_step(batch, loss="sft")
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    masters = ours._masters
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))
    assert not masters.compute_grad.any()
    ref_params = fsdp.full_parameters()
    for name, p in ours.full_parameters().items():
        torch.testing.assert_close(p, ref_params[name], atol=1e-6, rtol=1e-5, msg=name)
    # A second step: parameters whose gradient is noise near zero may step either way after
    # one float32 rounding apart, so compare the loss only.
    got, ref = ours.train_step(batch, loss="sft"), fsdp.train_step(batch, loss="sft")
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)


def test_pinned_staging_on_gpu():
    """Pinned buffers in turn: every micro-batch's tensors reach the GPU whole, although the
    buffers are rewritten while earlier copies may still be queued."""
    from trainer_core import PinnedStaging

    staging = PinnedStaging()
    device = torch.device("cuda")
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the copies queue behind it
    gen = torch.Generator().manual_seed(0)
    sent, got = [], []
    for rows in (4096, 2048, 8192, 4096, 1024):
        parts = [torch.randn(rows, 1536, generator=gen) for _ in range(2)]
        ids = torch.randint(0, 150_000, (rows,), generator=gen)
        sent.append([torch.cat(parts), ids, ids > 75_000])
        got.append(staging.copy_to([parts, ids, ids > 75_000], device))
    for expected, out in zip(sent, got, strict=True):
        for e, o in zip(expected, out, strict=True):
            assert o.is_cuda and torch.equal(o.cpu(), e)


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_qwen3_5_packed_logprobs_equal_one_sample_at_a_time_on_gpu(
    make_config, make_small_batch, logprobs_packed_and_alone, preset
):
    """Qwen3.5 on CUDA (float32, so a leak across samples, ~1e-2, stands out from rounding):
    the varlen kernels where fla and causal_conv1d are installed, else the per-sample path."""
    from vlm_models.presets import PRESETS

    if preset not in PRESETS:
        pytest.skip(f"{preset} needs a newer transformers")
    actor = FsdpActor(make_config(model=preset, device="cuda", param_dtype="float32"))
    packed, alone = logprobs_packed_and_alone(actor, make_small_batch(preset))
    for p, a in zip(packed, alone, strict=True):
        torch.testing.assert_close(p, a, rtol=0, atol=1e-4)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_host_optimizer_on_gpu(make_config, batch, fraction):
    """The optimizer on the host with the copies on their CUDA streams: one step lands where
    the compiled flat update on the GPU does, to float32 rounding of the two AdamW kernels
    (compared one step only: bf16 weights turn a rounding into a different next gradient);
    the bf16 weights are the masters' cast; offload and onload keep the host part in place."""
    from trainers_fsdp import OptimConfig

    optim = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    kw = dict(device="cuda", max_tokens_per_gpu=64, optim=optim)
    device = FsdpActor(make_config(**kw))
    host = FsdpActor(make_config(optimizer_offload=fraction, **kw))
    masters = host._masters
    assert masters.host_master.is_pinned() and masters.host_end > 0
    assert host.train_step(batch, loss="grpo")["update_skipped"] == 0.0
    device.train_step(batch, loss="grpo")
    ref = device.full_parameters()
    for name, p in host.full_parameters().items():
        torch.testing.assert_close(p.cpu(), ref[name].cpu(), rtol=1e-5, atol=1e-6, msg=name)
    whole = torch.cat([masters.host_master, masters.master.cpu()]).to(torch.bfloat16)
    assert torch.equal(masters.compute.cpu(), whole)
    host.offload()
    assert masters.host_master.device.type == "cpu"
    host.onload()
    assert host.train_step(batch, loss="grpo")["update_skipped"] == 0.0
