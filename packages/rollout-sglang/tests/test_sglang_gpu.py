"""The real SGLang engine: runs where sglang, a GPU and a Qwen3-VL checkpoint are present.

Set GLIMPSE_SGLANG_MODEL to a local Qwen3-VL folder (with weights) to run it.
"""

from __future__ import annotations

import os

import pytest
import torch

from rollout_sglang.sglang_client.common import SGLangConfig, sglang_available
from rollout_sglang.sglang_client.engine import SGLangEngine
from rollout_sglang.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sglang_available(), reason="sglang not installed (uv sync --extra gpu)"),
    pytest.mark.skipif(
        not os.environ.get("GLIMPSE_SGLANG_MODEL"), reason="GLIMPSE_SGLANG_MODEL not set"
    ),
]


@pytest.fixture(scope="module")
def engine():
    config = SGLangConfig(
        model_path=os.environ["GLIMPSE_SGLANG_MODEL"],
        mem_fraction_static=0.5,
        mm_attention_backend="sdpa",
    )
    engine = SGLangEngine(config)
    yield engine
    engine.shutdown()


def test_generate_update_release(engine, prompt_samples):
    from transformers import AutoModelForImageTextToText

    requests = [GenerateRequest.from_prompt(s) for s in prompt_samples[:2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(requests, params)
    assert all(c.ok and len(c.logprobs) == c.response_length > 0 for c in before)
    model = AutoModelForImageTextToText.from_pretrained(
        os.environ["GLIMPSE_SGLANG_MODEL"], dtype=torch.bfloat16
    ).cuda()
    noisy = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in model.named_parameters()]
    engine.update_weights([noisy])
    assert [c.token_ids for c in engine.generate(requests, params)] != [c.token_ids for c in before]
    engine.release_memory()
    engine.resume_memory()
    assert engine.health()
