"""The Megatron actor's AdamW (megatron-core's torch fallback, no Apex / Transformer Engine)
steps in torch's fused kernel, with the arithmetic of torch's default ``foreach`` AdamW."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch

from rl_algos import TrainBatch
from trainers_megatron import MegatronActor, MegatronConfig
from trainers_megatron.optim import optimizers


def _batch(vocab: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in (12, 9)]
    masks = [torch.cat([torch.zeros(len(t) - 4), torch.ones(4)]) for t in ids]
    return TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        advantages=[m * s for m, s in zip(masks, (1.0, -0.5), strict=True)],
    )


def _weights_after_a_step(fused: bool) -> tuple[dict, dict, list[bool]]:
    """(weights before, weights after one GRPO step, each group's fused flag)."""
    actor = MegatronActor(MegatronConfig(model="qwen3-vl-tiny", lr=1e-2, weight_decay=0.1, seed=0))
    groups = [g for opt in optimizers(actor.optimizer) for g in opt.optimizer.param_groups]
    if not fused:  # back to torch's default, as megatron-core builds it
        for g in groups:
            g["fused"], g["foreach"] = False, True
    flags = [bool(g["fused"]) for g in groups]

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in actor.module.named_parameters()}

    before = weights()
    batch = _batch(actor.hf_config.text_config.vocab_size)
    batch.old_logprobs = actor.compute_logprobs(batch)
    actor.train_step(batch, loss="grpo")
    return before, weights(), flags


def test_adamw_runs_fused_and_updates_as_the_foreach_default():
    before, fused, flags = _weights_after_a_step(fused=True)
    _, reference, _ = _weights_after_a_step(fused=False)
    assert flags and all(flags)
    changed = [n for n, w in fused.items() if not torch.equal(w, before[n])]
    assert len(changed) > len(fused) // 2  # the step moved the weights
    for name, w in fused.items():
        torch.testing.assert_close(w, reference[name], rtol=0, atol=1e-6, msg=name)
