"""GPU-only behaviour: bf16 mixed precision and offload / onload (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from trainers_fsdp import FsdpActor

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
