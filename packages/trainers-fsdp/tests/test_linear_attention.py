"""Qwen3.5 (gated delta net + full attention) through the actor: a packed micro-batch gives
each sample the log-probs and gradients it gets alone."""

from __future__ import annotations

import logging

import pytest
import torch

import trainers_fsdp.actor as actor_module
import trainers_fsdp.model as model_module
from trainers_fsdp.actor import FsdpActor
from vlm_models.presets import PRESETS


@pytest.mark.parametrize(
    ("preset", "attn", "atol"),
    [
        ("qwen3.5-tiny", "packed", 1e-5),
        ("qwen3.5-moe-tiny", "packed", 1e-5),
        ("qwen3.5-tiny", "sdpa", 1e-5),  # transformers' full attention, boundaries by positions
        ("qwen3-vl-tiny", "packed", 1e-6),
    ],
)
def test_packed_logprobs_equal_one_sample_at_a_time(
    make_config, make_small_batch, logprobs_packed_and_alone, preset, attn, atol
):
    """The FSDP actor's compute_logprobs; Qwen3-VL is the control (no linear attention)."""
    if preset not in PRESETS:
        pytest.skip(f"{preset} needs a newer transformers")
    actor = FsdpActor(make_config(model=preset, attn_implementation=attn, logprobs_scope="all"))
    packed, alone = logprobs_packed_and_alone(actor, make_small_batch(preset))
    for p, a in zip(packed, alone, strict=True):
        torch.testing.assert_close(p, a, rtol=0, atol=atol)


def test_packed_gradients_equal_one_sample_at_a_time(make_config, make_small_batch):
    """Training sees it too: one packed GRPO micro-batch accumulates the gradient of three."""
    if "qwen3.5-tiny" not in PRESETS:
        pytest.skip("Qwen3.5 needs a newer transformers")
    batch = make_small_batch("qwen3.5-tiny")
    actor = FsdpActor(make_config(model="qwen3.5-tiny"))
    grads = []
    for budget, rows in ((sum(batch.lengths), 1), (1, len(batch))):
        actor.config.max_tokens_per_gpu = budget
        assert actor.forward_backward(batch, loss="grpo")["num_micro_batches"] == rows
        grads.append(actor.full_gradients())
        actor.zero_grad()
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def _without_the_reset(monkeypatch) -> None:
    """The actor's model built with transformers' gated delta net (no state reset)."""
    build = model_module.build_model

    def build_without(*args, **kwargs):
        return build(*args, **{**kwargs, "packed_linear_attention": False})

    monkeypatch.setattr(model_module, "build_model", build_without)


def test_an_unpackable_model_runs_one_sample_per_micro_batch(
    make_config, make_small_batch, logprobs_packed_and_alone, monkeypatch, caplog
):
    """Linear-attention layers that do not reset at boundaries: the actor says so once and
    never packs two samples into one row."""
    if "qwen3.5-tiny" not in PRESETS:
        pytest.skip("Qwen3.5 needs a newer transformers")
    _without_the_reset(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="trainers_fsdp.actor"):
        actor = FsdpActor(make_config(model="qwen3.5-tiny"))
    warnings = [r for r in caplog.records if "one sample per micro-batch" in r.message]
    assert len(warnings) == 1
    packed, alone = logprobs_packed_and_alone(actor, make_small_batch("qwen3.5-tiny"))
    for p, a in zip(packed, alone, strict=True):  # bit-equal: the same one-sample rows
        torch.testing.assert_close(p, a, rtol=0, atol=0)


def test_packing_without_the_reset_is_what_the_equality_test_catches(
    make_config, make_small_batch, logprobs_packed_and_alone, monkeypatch
):
    """Negative control: the FSDP path as it was before the reset (packing Qwen3.5 without
    asking, the state carried across samples) moves the later samples' log-probs far past
    the 1e-5 the test above holds the actor to."""
    if "qwen3.5-tiny" not in PRESETS:
        pytest.skip("Qwen3.5 needs a newer transformers")
    _without_the_reset(monkeypatch)
    monkeypatch.setattr(actor_module, "supports_packed_forward", lambda model: True)
    actor = FsdpActor(make_config(model="qwen3.5-tiny", logprobs_scope="all"))
    packed, alone = logprobs_packed_and_alone(actor, make_small_batch("qwen3.5-tiny"))
    worst = max(float((p - a).abs().max()) for p, a in zip(packed, alone, strict=True))
    assert worst > 1e-3, worst
