"""A world of one without FSDP: bf16 compute weights over flat float32 masters."""

from __future__ import annotations

import pytest
import torch

from trainers_fsdp import FsdpActor, OptimConfig

BF16 = dict(param_dtype="bfloat16", max_tokens_per_gpu=64)  # several micro-batches per step


def _run(actor: FsdpActor, batch) -> tuple[list, list[dict], dict]:
    before = actor.compute_logprobs(batch)
    steps = [actor.train_step(batch, loss="grpo"), actor.train_step(batch, loss="sft")]
    return before, steps, actor.full_parameters()


def test_masters_equal_fsdp_on_one_rank_exactly(make_config, batch):
    """The flat master weights compute what FSDP's mixed precision does on one rank, bit for
    bit: the same bf16 casts, float32 gradient accumulation over micro-batches and AdamW."""
    fsdp = FsdpActor(make_config(shard_single_rank=True, **BF16))
    ours = FsdpActor(make_config(**BF16))
    assert type(fsdp.model).__name__.startswith("FSDP")
    assert not type(ours.model).__name__.startswith("FSDP")
    lp_ref, steps_ref, params_ref = _run(fsdp, batch)
    lp, steps, params = _run(ours, batch)
    assert steps_ref[0]["num_micro_batches"] >= 3
    for a, b in zip(lp, lp_ref, strict=True):
        assert torch.equal(a, b)
    for got, ref in zip(steps, steps_ref, strict=True):
        for key in ("loss", "grad_norm", "entropy", "clip_frac"):
            if key in ref:
                assert got[key] == ref[key], key
    assert params.keys() == params_ref.keys()
    for name, p in params_ref.items():
        assert p.dtype == params[name].dtype == torch.float32, name
        assert torch.equal(params[name], p), name


def test_model_weights_are_views_of_the_flat_buffers(make_config, batch):
    actor = FsdpActor(make_config(**BF16))
    masters = actor._masters
    storage = masters.compute.untyped_storage().data_ptr()
    for name, p in actor.model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert p.untyped_storage().data_ptr() == storage, name
        assert p.grad is not None and not p.grad.any(), name  # zeroed accumulator view
    actor.train_step(batch, loss="sft")
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))  # refreshed
    assert not masters.compute_grad.any()  # moved to float32 after each micro-batch
    rope = actor.model.model.language_model.rotary_emb.inv_freq
    assert rope.dtype == torch.float32  # buffers keep their dtype, as under FSDP


def test_gradients_accumulate_in_float32(make_config, batch):
    """Two forward_backward calls without a step leave the sum of their gradients, in float32
    (zero_grad in between starts afresh)."""
    actor = FsdpActor(make_config(**BF16))
    actor.forward_backward(batch, loss="sft")
    once = actor.full_gradients()
    actor.forward_backward(batch, loss="sft")
    twice = actor.full_gradients()
    actor.zero_grad()
    assert all(g.abs().sum() == 0 for g in actor.full_gradients().values())
    for name, g in once.items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(twice[name], 2 * g, atol=1e-9, rtol=1e-6)


def test_checkpoints_move_between_fsdp_and_masters(make_config, batch, tmp_path):
    """A checkpoint of the FSDP actor resumes in the one-rank master-weight actor (same names,
    float32 values, optimizer state) and the next step is the one FSDP would take."""
    optim = OptimConfig(lr=1e-2, lr_schedule="cosine", warmup_steps=1, total_steps=5)
    fsdp = FsdpActor(make_config(shard_single_rank=True, optim=optim, **BF16))
    fsdp.train_step(batch, loss="grpo")
    fsdp.save_checkpoint(tmp_path / "ckpt")
    expected = fsdp.train_step(batch, loss="grpo")

    ours = FsdpActor(make_config(optim=optim, seed=7, **BF16))
    ours.load_checkpoint(tmp_path / "ckpt")
    assert ours.step == 1
    got = ours.train_step(batch, loss="grpo")
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == expected[key], key
    ref = fsdp.full_parameters()
    for name, p in ours.full_parameters().items():
        assert torch.equal(p, ref[name]), name


def test_export_reads_the_float32_masters(make_config, batch):
    actor = FsdpActor(make_config(export_dtype="float32", **BF16))
    actor.train_step(batch, loss="sft")
    exported = {n: t for bucket in actor.iter_hf_weights(1 << 20) for n, t in bucket}
    masters = actor.full_parameters()
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    assert exported[name].dtype == torch.float32
    assert torch.equal(exported[name], masters[name])
    assert not torch.equal(exported[name], masters[name].bfloat16().float())  # not the bf16 copy


def test_frozen_vision_keeps_its_weights_and_gets_no_gradient(make_config, batch):
    actor = FsdpActor(make_config(freeze_vision=True, **BF16))
    before = actor.full_parameters()
    actor.train_step(batch, loss="sft")
    after = actor.full_parameters()
    grads = actor.full_gradients()
    vision = [n for n in before if n.startswith("model.visual.")]
    assert vision and not any(n in grads for n in vision)
    assert all(torch.equal(after[n], before[n]) for n in vision)
    assert not torch.equal(
        after["model.language_model.norm.weight"], before["model.language_model.norm.weight"]
    )


def test_float32_compute_needs_no_masters(make_config):
    from trainers_fsdp.master import MasterWeights

    actor = FsdpActor(make_config())
    assert actor._masters is None and next(actor.model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="float32"):
        MasterWeights(actor.model, torch.float32, torch.device("cpu"))


def test_move_rebuilds_weights_from_the_masters(make_config, batch):
    """An offload moves the masters (and an accumulated gradient) only; the onload casts the
    bf16 weights again and starts a zero bf16 gradient buffer. The CPU stands in for both ends
    (the actor offloads only from a GPU; the gpu tests run the round trip there)."""
    actor = FsdpActor(make_config(**BF16))
    actor.train_step(batch, loss="sft")
    before = actor.compute_logprobs(batch)
    masters = actor._masters
    actor.forward_backward(batch, loss="sft")  # a gradient is pending: it must survive
    grads = actor.full_gradients()
    cpu = torch.device("cpu")
    masters.to(cpu, fill=False)
    masters.compute.fill_(float("nan"))  # unfilled while offloaded: whatever was there
    masters.to(cpu)
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))
    assert not masters.compute_grad.any()
    for name, g in actor.full_gradients().items():
        assert torch.equal(g, grads[name]), name
    actor.zero_grad()
    for a, b in zip(actor.compute_logprobs(batch), before, strict=True):
        assert torch.equal(a, b)
    model_storage = next(actor.model.parameters()).untyped_storage().data_ptr()
    assert model_storage == masters.compute.untyped_storage().data_ptr()  # views re-pointed
    assert actor.train_step(batch, loss="sft")["update_skipped"] == 0.0
