"""Fixtures for the trainers-fsdp tests: a tiny Qwen3-VL actor on CPU (world of one)."""

from __future__ import annotations

import pytest
import torch

from trainers_fsdp import FsdpConfig, OptimConfig
from trainers_fsdp.synthetic import TINY_OVERRIDES, synthetic_batch
from vlm_models.build import build_model
from vlm_models.presets import tiny_config


def tiny_actor_config(**kwargs) -> FsdpConfig:
    base = dict(
        model="qwen3-vl-tiny",
        model_overrides=dict(TINY_OVERRIDES),
        device="cpu",
        max_tokens_per_gpu=96,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        seed=0,
    )
    base.update(kwargs)
    return FsdpConfig(**base)


def plain_model(seed: int = 0) -> torch.nn.Module:
    """The same tiny model as the actor's (same seed), unsharded, transformers' sdpa."""
    torch.manual_seed(seed)
    return build_model("qwen3-vl-tiny", attn_implementation="sdpa", **TINY_OVERRIDES).eval()


def mixed_batch(seed: int = 0, grpo: bool = True):
    """Five samples: three with one image each (different grids), two text-only."""
    config = tiny_config(**TINY_OVERRIDES)
    return synthetic_batch(
        config,
        [40, 24, 52, 18, 30],
        image_patches=[(4, 4), None, (4, 6), None, (2, 2)],
        seed=seed,
        grpo=grpo,
    )


# Two images and a text-only sample: short enough that one budget packs them into one row.
SMALL_LENGTHS, SMALL_PATCHES = [24, 10, 14], [(4, 4), None, (2, 2)]


def small_batch(preset: str):
    """Three samples for ``preset`` (any tiny preset, with the small-vocabulary overrides)."""
    config = tiny_config(preset, **TINY_OVERRIDES)
    return synthetic_batch(config, SMALL_LENGTHS, image_patches=SMALL_PATCHES)


def packed_and_alone(actor, batch) -> tuple[list, list]:
    """Log-probs with every sample in one micro-batch, then with one sample per micro-batch."""
    actor.config.max_tokens_per_gpu = sum(batch.lengths)
    packed = actor.compute_logprobs(batch)
    actor.config.max_tokens_per_gpu = 1  # each sample longer than the budget: one per row
    alone = actor.compute_logprobs(batch)
    return packed, alone


@pytest.fixture
def make_small_batch():
    return small_batch


@pytest.fixture
def logprobs_packed_and_alone():
    return packed_and_alone


@pytest.fixture
def batch():
    return mixed_batch()


@pytest.fixture
def make_config():
    return tiny_actor_config


@pytest.fixture
def make_plain_model():
    return plain_model
