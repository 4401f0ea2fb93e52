"""Shared fixtures: the real Qwen3-VL processor, real geo3k images, a tiny random model."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors only under its interpreter, which has to be
# on before triton is first imported (the imports below bring it in): the decode-attention
# tests then check the kernel itself on the CPU. (A whole-suite run may have imported triton
# earlier; those tests then say so and skip.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout_sglang.types import GenerateRequest
from vlm_data.loading import load_rows
from vlm_data.processor import build_processor
from vlm_data.prompts import PromptBuilder
from vlm_models.build import build_model
from vlm_models.presets import tiny_config

# 32 px per merged token side: 4..16 vision tokens per image keeps CPU tests fast.
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 16


@pytest.fixture(scope="session")
def processor(qwen3vl_dir):
    return build_processor(qwen3vl_dir, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="session")
def prompt_samples(processor, geo3k_dir):
    rows = load_rows(geo3k_dir, split="validation")
    builder = PromptBuilder(processor, template="boxed")
    return [builder.build(rows[i], i) for i in range(4)]


@pytest.fixture
def requests_(prompt_samples) -> list[GenerateRequest]:
    return [GenerateRequest.from_prompt(s) for s in prompt_samples]


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return build_model(tiny_config())
