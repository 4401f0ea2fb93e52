"""``MegatronConfig.compile``: decoder layers, vision blocks and log-prob kernels compiled give
the eager actor's log-probs and first step (CPU: aot_eager, the graphs inductor would get)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch

from trainers_fsdp.synthetic import TINY_OVERRIDES, synthetic_batch
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor


def _actor(compile: bool) -> MegatronActor:
    torch._dynamo.reset()
    return MegatronActor(
        MegatronConfig(
            model="qwen3-vl-tiny", model_overrides=dict(TINY_OVERRIDES), compile=compile, seed=0
        )
    )


@pytest.mark.slow
def test_compiled_actor_equals_eager():
    eager = _actor(compile=False)
    batch = synthetic_batch(eager.hf_config, [96, 72], image_patches=[(8, 8)] * 2, seed=3)
    ref_before = eager.compute_logprobs(batch)
    batch.old_logprobs = ref_before
    ref = eager.train_step(batch, loss="grpo")
    ref_after = eager.compute_logprobs(batch)
    del eager

    compiled = _actor(compile=True)
    blocks = compiled.module.visual.blocks
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    for ours, theirs in zip(compiled.compute_logprobs(batch), ref_before, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    ours = compiled.train_step(batch, loss="grpo")
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    for ours, theirs in zip(compiled.compute_logprobs(batch), ref_after, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
