"""The actor on CPU, world of one: log-probs, packing, loss scaling, SFT/GRPO steps."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.parallelize import apply_compile

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _hf_sample_logprobs(model, ids, pixels, grid, image_token_id) -> torch.Tensor:
    kwargs = dict(input_ids=ids[None])
    if pixels is not None:
        kwargs.update(
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(ids == image_token_id).int()[None],
        )
    with torch.no_grad():
        logits = model(**kwargs).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).squeeze(1)
    return torch.cat([lp.new_zeros(1), lp])


@pytest.mark.parametrize("scope,fused_vision", [("all", False), ("loss", False), ("loss", True)])
def test_compute_logprobs_equals_plain_hf_forward(
    make_config, make_plain_model, batch, scope, fused_vision
):
    """All positions ("all"), or the loss positions with zeros elsewhere ("loss", default);
    with the fused vision attention too."""
    actor = FsdpActor(make_config(logprobs_scope=scope, fused_vision_attention=fused_vision))
    plain = make_plain_model()
    ours = actor.compute_logprobs(batch)
    image_token = plain.config.image_token_id
    for i, ids in enumerate(batch.input_ids):
        ref = _hf_sample_logprobs(
            plain, ids, batch.pixel_values[i], batch.image_grid_thw[i], image_token
        )
        assert ours[i].shape == ids.shape
        assert ours[i][0] == 0
        if scope == "loss":
            on = batch.loss_mask[i] > 0
            assert torch.all(ours[i][~on] == 0)
            ref = torch.where(on, ref, torch.zeros_like(ref))
        torch.testing.assert_close(ours[i], ref, atol=2e-5, rtol=1e-5)


def test_packed_equals_padded(make_config, make_plain_model, batch):
    """Samples packed into one row give the log-probs of a right-padded batched forward."""
    actor = FsdpActor(make_config(max_tokens_per_gpu=10_000, logprobs_scope="all"))  # one row
    packed = actor.compute_logprobs(batch)
    plain = make_plain_model()
    n, longest = len(batch), max(batch.lengths)
    ids = torch.zeros(n, longest, dtype=torch.long)
    attn = torch.zeros(n, longest, dtype=torch.long)
    for i, x in enumerate(batch.input_ids):
        ids[i, : len(x)] = x
        attn[i, : len(x)] = 1
    grids = [g for g in batch.image_grid_thw if g is not None]
    with torch.no_grad():
        logits = plain(
            input_ids=ids,
            attention_mask=attn,
            pixel_values=torch.cat([p for p in batch.pixel_values if p is not None]),
            image_grid_thw=torch.cat(grids),
            mm_token_type_ids=(ids == plain.config.image_token_id).int(),
        ).logits.float()
    for i, x in enumerate(batch.input_ids):
        lp = torch.log_softmax(logits[i, : len(x) - 1], -1).gather(1, x[1:, None]).squeeze(1)
        torch.testing.assert_close(packed[i][1:], lp, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_accumulation_equals_one_big_batch(make_config, batch, agg):
    """Micro-batching changes nothing: the scaled micro-batch losses sum to the batch loss."""
    actor = FsdpActor(make_config())
    actor.config.grpo.loss_agg_mode = agg
    actor.config.max_tokens_per_gpu = 10_000
    one = actor.forward_backward(batch, loss="grpo")
    grads_one = actor.full_gradients()
    actor.zero_grad()
    actor.config.max_tokens_per_gpu = 48  # every sample on its own or in pairs
    many = actor.forward_backward(batch, loss="grpo")
    assert one["num_micro_batches"] == 1 and many["num_micro_batches"] >= 4
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for name, g in grads_one.items():
        torch.testing.assert_close(actor.full_gradients()[name], g, atol=1e-6, rtol=1e-4)


def test_sft_loss_decreases(make_config, batch):
    actor = FsdpActor(make_config())
    losses = [actor.train_step(batch, loss="sft")["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_grpo_step_with_reference_kl(make_config, batch):
    cfg = make_config(reference_model=True)
    cfg.grpo.kl_coef = 0.1
    actor = FsdpActor(cfg)
    batch.old_logprobs = actor.compute_logprobs(batch)
    batch.ref_logprobs = actor.compute_logprobs(batch, reference=True)
    for a, b in zip(batch.old_logprobs, batch.ref_logprobs, strict=True):
        torch.testing.assert_close(a, b)  # reference = initial weights
    first = actor.train_step(batch, loss="grpo")
    assert first["clip_frac"] == 0.0 and first["ratio_mean"] == pytest.approx(1.0)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    for key in ("loss", "grad_norm", "lr", "entropy", "approx_kl", "tokens", "tokens_per_s"):
        assert key in first
    assert first["tokens"] == batch.num_tokens
    assert first["loss_tokens"] == sum(int(m.sum()) for m in batch.loss_mask)
    second = actor.train_step(batch, loss="grpo")  # policy moved: ratio and KL move too
    assert second["kl_loss"] > 0 and second["ratio_max"] > 1.0
    # the reference did not move
    ref_again = actor.compute_logprobs(batch, reference=True)
    torch.testing.assert_close(ref_again[0], batch.ref_logprobs[0])


def test_grad_clipping_and_lr_schedule(make_config, batch):
    from trainers_fsdp import OptimConfig

    optim = OptimConfig(
        lr=1e-3, max_grad_norm=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=4
    )
    actor = FsdpActor(make_config(optim=optim))
    m = actor.forward_backward(batch, loss="sft")
    out = actor.optimizer_step()
    assert out["grad_norm"] > 1e-3  # reported before clipping
    assert out["lr"] == pytest.approx(0.5e-3)  # warmup step 1 of 2
    lrs = [actor.train_step(batch, loss="sft")["lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-3, 0.5e-3, 0.0])  # warmup end, cosine middle, floor
    assert m["num_micro_batches"] >= 2


def test_bad_requests_are_clear(make_config, batch):
    actor = FsdpActor(make_config())
    batch.advantages = None
    with pytest.raises(ValueError, match="advantages"):
        actor.train_step(batch, loss="grpo")
    with pytest.raises(ValueError, match="loss must be"):
        actor.train_step(batch, loss="dpo")
    with pytest.raises(ValueError, match="reference_model"):
        actor.compute_logprobs(batch, reference=True)


def test_device_side_clip_and_skip_equal_host_path(make_config, batch):
    """The fused optimizer's no-sync step (clip coefficient and non-finite skip on the device)
    updates exactly as the host path does, and a NaN gradient leaves the weights unchanged."""
    from trainers_fsdp import OptimConfig

    def run(fused: bool):
        optim = OptimConfig(lr=1e-3, max_grad_norm=1e-2)
        actor = FsdpActor(make_config(optim=optim, fused_adamw=fused))
        metrics = actor.train_step(batch, loss="sft")
        params = actor.full_parameters()
        return actor, metrics, params

    _, m_host, p_host = run(False)
    actor, m_dev, p_dev = run(True)
    assert m_dev["grad_norm"] == pytest.approx(m_host["grad_norm"], rel=1e-6)
    assert m_dev["update_skipped"] == 0.0 and m_dev["loss"] == pytest.approx(m_host["loss"])
    for name, p in p_host.items():
        torch.testing.assert_close(p_dev[name], p, atol=1e-6, rtol=1e-5)

    batch.advantages = [a.float() * float("nan") for a in batch.advantages]
    lr_before = actor.scheduler.get_last_lr()[0]
    out = actor.train_step(batch, loss="grpo")
    assert out["update_skipped"] == 1.0
    assert actor.scheduler.get_last_lr()[0] == lr_before
    for name, p in actor.full_parameters().items():
        torch.testing.assert_close(p, p_dev[name], atol=0, rtol=0)


def test_compile_default_is_dense_qwen3_vl_on_cuda(make_config):
    from trainers_fsdp.parallelize import compile_by_default
    from vlm_models.presets import preset_config

    dense, moe = preset_config("qwen3-vl-tiny"), preset_config("qwen3-vl-moe-tiny")
    assert compile_by_default(torch.device("cuda"), dense)
    assert not compile_by_default(torch.device("cuda"), moe)
    assert not compile_by_default(torch.device("cpu"), dense)
    assert FsdpActor(make_config()).compile is False  # CPU: decided, and off


@pytest.mark.slow
def test_compiled_actor_equals_eager(make_config, batch, monkeypatch):
    """compile=True, the GPU default for dense Qwen3-VL, gives the eager actor's log-probs and
    first training step: the compiled layers and vision blocks under FSDP, with the injected
    vision inputs, in both grad modes. The aot_eager backend traces as inductor would but makes
    no kernels (inductor's C++ build takes minutes on CPU; the gpu tests run it). On CPU the
    attention inside is per-sample sdpa, not the GPU's varlen kernel."""
    import trainers_fsdp.model as model_module

    monkeypatch.setattr(
        model_module, "apply_compile", functools.partial(apply_compile, backend="aot_eager")
    )
    one_row = dict(max_tokens_per_gpu=1024)  # one micro-batch: one traced shape per grad mode
    eager = FsdpActor(make_config(compile=False, **one_row))
    compiled = FsdpActor(make_config(compile=True, **one_row))
    assert compiled.compile and not eager.compile
    before = compiled.compute_logprobs(batch)
    for ours, ref in zip(before, eager.compute_logprobs(batch), strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    ours, ref = compiled.train_step(batch), eager.train_step(batch)
    for key in ("loss", "grad_norm", "entropy"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    after = compiled.compute_logprobs(batch)
    assert not torch.equal(after[0], before[0])  # the step changed the weights
    for ours, ref in zip(after, eager.compute_logprobs(batch), strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
