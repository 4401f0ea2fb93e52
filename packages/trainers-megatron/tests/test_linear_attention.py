"""Qwen3.5 (gated delta net + full attention) through the Megatron actor, one process on CPU:
samples packed into one micro-batch get the log-probs and gradients they get alone, and a model
whose linear attention cannot reset at boundaries runs one sample per micro-batch by itself."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos import TrainBatch
from vlm_models.presets import PRESETS, tiny_config

pytestmark = [
    pytest.mark.skipif("qwen3.5-tiny" not in PRESETS, reason="needs Qwen3.5"),
    pytest.mark.usefixtures("one_process"),
]
IDS = dict(
    vocab_size=151936,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)


@pytest.fixture(scope="module")
def batch(geo3k_dir: Path, qwen3vl_dir: Path) -> TrainBatch:
    """An image prompt, a text-only prompt, another image prompt; 8 response tokens each."""
    import pandas as pd
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(qwen3vl_dir)
    rows = pd.read_parquet(geo3k_dir / "validation.parquet").head(2)
    images = [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in rows.iloc]
    gen = torch.Generator().manual_seed(0)
    fields: dict[str, list] = {
        k: [] for k in ("input_ids", "loss_mask", "advantages", "pixel_values", "image_grid_thw")
    }
    for image, text, sign in (
        (images[0], "Find x.", 1.0),
        (None, "2+2?", -1.0),
        (images[1], "Why?", 0.5),
    ):
        content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        out = processor(
            text=[prompt], images=[image] if image else None, return_tensors="pt",
            max_pixels=32 * 32 * 16,
        )  # fmt: skip
        ids = torch.cat([out["input_ids"][0], torch.randint(0, 150000, (8,), generator=gen)])
        mask = torch.zeros(len(ids))
        mask[-8:] = 1.0
        fields["input_ids"].append(ids)
        fields["loss_mask"].append(mask)
        fields["advantages"].append(mask * sign)
        fields["pixel_values"].append(out.get("pixel_values"))
        fields["image_grid_thw"].append(out.get("image_grid_thw"))
    return TrainBatch(**fields)


def _actor(preset: str = "qwen3.5-tiny", **kwargs):
    from rl_algos.optimizer import OptimConfig
    from trainers_megatron import MegatronConfig
    from trainers_megatron.actor import MegatronActor

    optim = OptimConfig(lr=1e-3, weight_decay=0.0)
    config = dict(model=tiny_config(preset, **IDS), optim=optim, seed=0)
    return MegatronActor(MegatronConfig(**config, **kwargs))


def _packed_and_alone(actor, batch: TrainBatch) -> tuple[list, list]:
    actor.config.max_tokens_per_gpu = sum(batch.lengths)
    assert len(actor.micro_batches(batch)) == 1
    packed = actor.compute_logprobs(batch)
    actor.config.max_tokens_per_gpu = 1  # every sample longer than the budget: one per row
    assert len(actor.micro_batches(batch)) == len(batch)
    return packed, actor.compute_logprobs(batch)


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_packed_logprobs_equal_one_sample_at_a_time(batch, preset):
    packed, alone = _packed_and_alone(_actor(preset), batch)
    for p, a in zip(packed, alone, strict=True):
        assert p.abs().max() > 1.0  # real log-probs on the response tokens
        torch.testing.assert_close(p, a, rtol=0, atol=1e-5)


def test_packed_gradients_equal_one_sample_at_a_time(batch):
    """Training sees it too: one packed GRPO micro-batch accumulates the gradient of three."""
    actor = _actor()
    grads = []
    for budget, rows in ((sum(batch.lengths), 1), (1, len(batch))):
        actor.config.max_tokens_per_gpu = budget
        assert actor.forward_backward(batch, loss="grpo")["num_micro_batches"] == rows
        grads.append(
            {
                n: p.main_grad.clone()
                for n, p in actor.module.named_parameters()
                if "visual" not in n
            }
        )
        actor.model.zero_grad_buffer()
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_that_cannot_pack_runs_one_sample_per_micro_batch(batch, monkeypatch, caplog):
    from vlm_models.megatron import PackedGatedDeltaNet

    monkeypatch.setattr(PackedGatedDeltaNet, "packs_samples", False)
    with caplog.at_level(logging.WARNING, logger="trainers_megatron.actor"):
        actor = _actor()
    assert sum("one sample per micro-batch" in r.message for r in caplog.records) == 1
    actor.config.max_tokens_per_gpu = sum(batch.lengths)  # a budget that would pack all three
    assert len(actor.micro_batches(batch)) == len(batch)
