"""Fixtures for the trainers-fsdp tests: a tiny Qwen3-VL actor on CPU (world of one)."""

from __future__ import annotations

import pytest
import torch

from trainers_fsdp import TINY_OVERRIDES, FsdpConfig, OptimConfig, synthetic_batch
from vlm_models import build_model, tiny_config


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


@pytest.fixture
def batch():
    return mixed_batch()


@pytest.fixture
def make_config():
    return tiny_actor_config


@pytest.fixture
def make_plain_model():
    return plain_model
