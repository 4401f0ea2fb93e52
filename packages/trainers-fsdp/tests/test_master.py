"""A world of one without FSDP: bf16 compute weights over flat float32 masters."""

from __future__ import annotations

import logging

import pytest
import torch

from trainers_fsdp import OptimConfig
from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.synthetic import TINY_OVERRIDES
from vlm_models.build import build_model

BF16 = dict(param_dtype="bfloat16", max_tokens_per_gpu=64)  # several micro-batches per step
# torch's AdamW per tensor over the masters: the arithmetic FSDP does, to compare bit for bit
PER_TENSOR = OptimConfig(lr=1e-2, weight_decay=0.0)


def _run(actor: FsdpActor, batch) -> tuple[list, list[dict], dict, dict]:
    before = actor.compute_logprobs(batch)
    first = actor.train_step(batch, loss="grpo")
    after_first = actor.full_parameters()
    second = actor.train_step(batch, loss="sft")
    return before, [first, second], after_first, actor.full_parameters()


def test_masters_equal_fsdp_on_one_rank(make_config, batch):
    """The flat master weights compute what FSDP's mixed precision does on one rank: the same
    bf16 casts, float32 gradient accumulation over micro-batches and AdamW.

    Everything computed before the first update runs the same kernels in the same order on the
    same bf16 weights, so it is compared bit for bit. The gradient norm is a float32 sum over
    one flat buffer here and over per-tensor norms under FSDP: a different summation order,
    which moves it by an ulp on some CPUs (2.6092946529 against 2.6092948914), so it gets a
    relative 1e-6 (float32 epsilon is 1.2e-7). That ulp reaches the clipping factor, so a few
    master weights may round to the other side of a bf16 boundary: the second step then runs on
    compute weights that differ by one bf16 ulp (2**-8 relative) in those few elements. The test
    checks that premise (under 1 % of the compute weights differ after the first step) and gives
    the second step's metrics a relative 1e-3: the measured gap is 1.3e-5 (AMD EPYC, loss
    6.048921 against 6.048998), and dropping one of the >= 3 micro-batches or scaling a
    gradient wrongly moves them by tens of percent.

    The final weights cannot all get a tight bound: AdamW divides each gradient by its own
    running RMS, so an element whose second gradient is near zero takes a step of near full
    size whose sign that tiny gradient decides, and the few compute weights one bf16 ulp apart
    move such gradients. Each weight gets two updates (2 lr: two AdamW steps of at most lr
    each, apart), and all but 2 % of them 1 % of one update. Measured on an AMD EPYC where 19
    of 487k compute weights differed after the first step: 0.8 % of the final weights past 1 %
    of an update, the largest 0.66 lr; where the gradient norms agree exactly, none. A wrong
    step size or a lost micro-batch moves nearly every weight past 1 %.
    """
    fsdp = FsdpActor(make_config(shard_single_rank=True, **BF16))
    ours = FsdpActor(make_config(optim=PER_TENSOR, flat_update=False, **BF16))
    assert type(fsdp.model).__name__.startswith("FSDP")
    assert not type(ours.model).__name__.startswith("FSDP")
    initial = ours.full_parameters()
    lp_ref, steps_ref, mid_ref, params_ref = _run(fsdp, batch)
    lp, steps, mid, params = _run(ours, batch)
    assert steps_ref[0]["num_micro_batches"] >= 3
    for a, b in zip(lp, lp_ref, strict=True):
        assert torch.equal(a, b)
    first, second = steps
    for key in ("loss", "entropy", "clip_frac"):
        assert first[key] == steps_ref[0][key], key
    assert first["grad_norm"] == pytest.approx(steps_ref[0]["grad_norm"], rel=1e-6, abs=0)
    differ = sum(int((mid[n].bfloat16() != p.bfloat16()).sum()) for n, p in mid_ref.items())
    assert differ <= 0.01 * sum(p.numel() for p in mid_ref.values())
    for key in ("loss", "grad_norm", "entropy"):
        assert second[key] == pytest.approx(steps_ref[1][key], rel=1e-3, abs=0), key
    assert params.keys() == params_ref.keys()
    lr = PER_TENSOR.lr
    off = total = 0
    for name, p in params_ref.items():
        assert p.dtype == params[name].dtype == torch.float32, name
        torch.testing.assert_close(params[name], p, rtol=0, atol=2 * lr, msg=name)
        off += int(((params[name] - p).abs() > lr * 1e-2).sum())
        total += p.numel()
        assert (p - initial[name]).abs().max() > lr / 2, name  # both stepped
    assert off <= 0.02 * total, (off, total)


@pytest.mark.parametrize("max_tokens", [64, 4096], ids=["micro-batches", "one micro-batch"])
def test_flat_update_is_torch_adamw(make_config, batch, max_tokens):
    """FlatAdamW (the CUDA default) takes the step torch's AdamW takes, to float32 rounding: with
    decay on matrices only, clipping, and over several micro-batches or one (whose bf16
    gradient it reads directly, never allocating the float32 one)."""
    optim = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    kw = dict(param_dtype="bfloat16", max_tokens_per_gpu=max_tokens)
    ref = FsdpActor(make_config(optim=OptimConfig(**optim), flat_update=False, **kw))
    ours = FsdpActor(make_config(optim=OptimConfig(**optim), flat_update=True, **kw))
    assert ours.optimizer.is_flat and not ref.optimizer.is_flat
    initial = ours.full_parameters()
    got = ours.train_step(batch, loss="grpo")
    expected = ref.train_step(batch, loss="grpo")
    assert got["loss"] == expected["loss"]
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    assert got["grad_norm"] > 0.5  # clipped
    ref_params = ref.full_parameters()
    for name, p in ours.full_parameters().items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(p, initial[name]), name
    masters = ours._masters
    assert (masters.grad is None) == (got["num_micro_batches"] == 1)
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))
    assert not masters.compute_grad.any()
    state = ours.optimizer.state_dict()["state"]
    assert {float(s["step"]) for s in state.values()} == {1.0}


def test_flat_update_is_the_cuda_default(make_config):
    """Uncompiled on the CPU the flat pass is slower than torch's foreach AdamW: it is the
    default on CUDA only (the gpu tests check it there)."""
    assert not FsdpActor(make_config(**BF16)).optimizer.is_flat
    assert FsdpActor(make_config(flat_update=True, **BF16)).optimizer.is_flat


def test_flat_update_keeps_torch_state_dict(make_config, batch):
    """The moments are views of two flat buffers but read, load and move as torch's
    per-parameter state: a loaded state dict lands in the flat buffers."""
    kw = dict(optim=OptimConfig(lr=1e-2, weight_decay=0.0), flat_update=True, **BF16)
    actor = FsdpActor(make_config(**kw))
    actor.train_step(batch, loss="sft")
    opt = actor.optimizer
    saved = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    other = FsdpActor(make_config(seed=3, **kw)).optimizer
    other.load_state_dict({"state": saved, "param_groups": opt.state_dict()["param_groups"]})
    flat = other.exp_avg.untyped_storage().data_ptr()
    for key, state in other.state_dict()["state"].items():
        assert state["exp_avg"].untyped_storage().data_ptr() == flat
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name], saved[key][name]), (key, name)
    other.to(torch.device("cpu"))  # the offload path: buffers move, the views follow
    assert next(iter(other.state.values()))["exp_avg"].untyped_storage().data_ptr() == (
        other.exp_avg.untyped_storage().data_ptr()
    )


def test_scattered_groups_fall_back_to_torch(make_config, batch):
    """Groups that are not contiguous runs of the flat buffers step as torch's AdamW does."""
    from trainers_fsdp.flat_adamw import FlatAdamW
    from trainers_fsdp.optim import build_scheduler

    actor = FsdpActor(make_config(**BF16))
    params = list(actor._masters.module.parameters())
    groups = [{"params": params[0::2]}, {"params": params[1::2], "weight_decay": 0.0}]
    actor.optimizer = FlatAdamW(groups, actor._masters, lr=1e-2, foreach=True)
    actor.scheduler = build_scheduler(actor.optimizer, actor.config.optim)
    assert not actor.optimizer.is_flat
    before = actor.full_parameters()
    assert actor.train_step(batch, loss="sft")["update_skipped"] == 0.0
    after = actor.full_parameters()
    assert all(not torch.equal(after[n], before[n]) for n in before)
    masters = actor._masters
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))


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


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
def test_checkpoints_move_between_fsdp_and_masters(make_config, batch, tmp_path, flat):
    """A checkpoint of the FSDP actor resumes in the one-rank master-weight actor (same names,
    float32 values, optimizer state) and the next step is the one FSDP would take, to float32
    rounding (FSDP and the masters sum the gradient norm in different orders)."""
    kw = dict(lr=1e-2, lr_schedule="cosine", warmup_steps=1, total_steps=5)
    fsdp = FsdpActor(make_config(shard_single_rank=True, optim=OptimConfig(**kw), **BF16))
    fsdp.train_step(batch, loss="grpo")
    fsdp.save_checkpoint(tmp_path / "ckpt")
    expected = fsdp.train_step(batch, loss="grpo")

    ours = FsdpActor(make_config(optim=OptimConfig(**kw), flat_update=flat, seed=7, **BF16))
    ours.load_checkpoint(tmp_path / "ckpt")
    assert ours.step == 1
    got = ours.train_step(batch, loss="grpo")
    for key in ("loss", "lr"):
        assert got[key] == expected[key], key
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    ref = fsdp.full_parameters()
    for name, p in ours.full_parameters().items():
        torch.testing.assert_close(p, ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_export_reads_the_float32_masters(make_config, batch):
    actor = FsdpActor(make_config(export_dtype="float32", **BF16))
    actor.train_step(batch, loss="sft")
    exported = {n: t for bucket in actor.iter_hf_weights(1 << 20) for n, t in bucket}
    masters = actor.full_parameters()
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    assert exported[name].dtype == torch.float32
    assert torch.equal(exported[name], masters[name])
    assert not torch.equal(exported[name], masters[name].bfloat16().float())  # not the bf16 copy


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_export_in_the_compute_dtype_reads_the_compute_weights(make_config, batch, offload):
    """A bf16 push reads the bf16 compute weights where they live (the GPU), not the float32
    masters (partly on the host with the optimizer there): the same values, since the compute
    weights are the masters' round-to-nearest cast after every step."""
    actor = FsdpActor(
        make_config(
            export_dtype="bfloat16",
            optimizer_offload=offload,
            max_tokens_per_gpu=64,
            param_dtype="bfloat16",
        )
    )
    actor.train_step(batch, loss="sft")
    compute = actor._masters.compute
    lo = compute.untyped_storage().data_ptr()
    hi = lo + compute.untyped_storage().nbytes()
    masters = actor.full_parameters()
    exported = [(n, t) for bucket in actor.iter_hf_weights(1 << 20, device=None) for n, t in bucket]
    params = [(n, t) for n, t in exported if n in masters]
    assert len(params) > 10
    for name, tensor in params:
        assert lo <= tensor.data_ptr() < hi, f"{name} was copied, not read in place"
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, masters[name].bfloat16()), name


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
    """An offload moves the masters (and an accumulated gradient, a pending bf16 one moved
    into float32 first) only; the onload casts the bf16 weights again and starts a zero bf16
    gradient buffer. The CPU stands in for both ends (the actor offloads only from a GPU; the
    gpu tests run the round trip there)."""
    actor = FsdpActor(make_config(param_dtype="bfloat16", max_tokens_per_gpu=4096))
    actor.train_step(batch, loss="sft")
    before = actor.compute_logprobs(batch)
    masters = actor._masters
    actor.forward_backward(batch, loss="sft")  # one micro-batch: its gradient is pending in bf16
    assert masters.single_grad() is not None
    pending = masters.compute_grad.float()
    cpu = torch.device("cpu")
    masters.to(cpu, fill=False)
    masters.compute.fill_(float("nan"))  # unfilled while offloaded: whatever was there
    masters.to(cpu)
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))
    assert not masters.compute_grad.any()
    assert torch.equal(masters.ready_grads(), pending)
    actor.zero_grad()
    for a, b in zip(actor.compute_logprobs(batch), before, strict=True):
        assert torch.equal(a, b)
    model_storage = next(actor.model.parameters()).untyped_storage().data_ptr()
    assert model_storage == masters.compute.untyped_storage().data_ptr()  # views re-pointed
    assert actor.train_step(batch, loss="sft")["update_skipped"] == 0.0


def _optimizer_state(actor) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": v
        for i, state in enumerate(actor.optimizer.state.values())
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def test_offload_round_trip_is_bit_exact_and_counts_its_bytes(make_config, batch):
    """The actor's whole move out and back (float32 masters, AdamW's moments and steps, the
    bf16 weights cast again) returns the state bit for bit and the next step equals that of a
    twin actor that never moved. The CPU stands in for both ends: the masters cross through
    their host buffers (counted: the bytes of the transfer rate); the optimizer's tensors are
    already where they go, so they count only on a GPU (its round trip: tests/test_gpu.py)."""
    config = make_config(param_dtype="bfloat16", max_tokens_per_gpu=4096)
    moved, twin = FsdpActor(config), FsdpActor(config)
    for actor in (moved, twin):
        actor.train_step(batch, loss="sft")
    masters = moved._masters
    state = {k: v.clone() for k, v in _optimizer_state(moved).items()}
    assert state
    master = masters.master.clone()
    expected = master.numel() * 4  # no float32 gradient after an update
    cpu = torch.device("cpu")
    assert moved._move(cpu, offload=True) == expected
    masters.compute.fill_(float("nan"))  # unfilled while offloaded
    assert moved._move(moved.device, offload=False) == expected
    assert torch.equal(masters.master, master)
    got = _optimizer_state(moved)
    assert got.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(got[key], value), key
    assert torch.equal(masters.compute, masters.master.to(torch.bfloat16))
    after = moved.train_step(batch, loss="sft"), twin.train_step(batch, loss="sft")
    for key in ("loss", "grad_norm", "lr"):
        assert after[0][key] == after[1][key], key
    assert torch.equal(masters.master, twin._masters.master)


def test_a_bf16_checkpoint_loads_narrow_with_the_same_masters(make_config, batch, tmp_path, caplog):
    """Masters from a bf16 checkpoint loaded in bf16 (``build_model(narrow_dtype=...)``) are
    the float32 load's, bit for bit, and so is every log-prob: bf16 widens exactly. A folder
    with one tensor stored in float32 (same values) still loads wide."""
    model = build_model("qwen3-vl-tiny", dtype=torch.bfloat16, **TINY_OVERRIDES)
    model.save_pretrained(tmp_path / "bf16")
    model.get_input_embeddings().float()
    model.save_pretrained(tmp_path / "mixed")
    actors = {}
    for name in ("bf16", "mixed"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vlm_models.build"):
            config = make_config(model=str(tmp_path / name), model_overrides={}, **BF16)
            actors[name] = FsdpActor(config)
        assert ("loaded as stored" in caplog.text) == (name == "bf16")
    narrow, wide = actors["bf16"], actors["mixed"]
    assert narrow._masters is not None and wide._masters is not None
    assert torch.equal(narrow._masters.master, wide._masters.master)
    for a, b in zip(narrow.compute_logprobs(batch), wide.compute_logprobs(batch), strict=True):
        assert torch.equal(a, b)
