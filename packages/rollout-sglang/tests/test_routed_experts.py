"""The transformers engine returns the experts it routed every token to (routing replay), in
SGLang's layout: ``[prompt + response - 1, layers, k]``.

In float32 the engine's prefill and decode steps route as transformers' forward over the whole
sequence does (their hidden states agree to ~1e-6, far from a top-k tie on random weights), so
the ids it returns must be the forward's own top-k for every row: prompt rows from the prefill,
response rows from the decode steps, across continuous batching (more requests than slots)."""

from __future__ import annotations

import pytest
import torch

from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.hf.routing import PrefillRouting
from rollout_sglang.types import GenerateRequest, SamplingParams
from vlm_models.build import build_model


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return HFEngine(build_model("qwen3.5-moe-tiny"), max_batch_size=2, return_routed_experts=True)


def _forward_routing(engine: HFEngine, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own top-k over ``ids`` (one sequence): ``[T, layers, k]``."""
    layers = engine.decoder.text.layers
    recorder = PrefillRouting(layers, engine.decoder.routing_shape[1])
    with torch.inference_mode(), recorder:
        engine.model.model(input_ids=ids[None])
    return torch.from_numpy(recorder.rows(1, ids.numel(), [ids.numel()])[0])


def test_routed_experts_are_the_forwards_top_k(engine):
    gen = torch.Generator().manual_seed(1)
    requests = [
        GenerateRequest(input_ids=torch.randint(100, 5000, (n,), generator=gen))
        for n in (7, 12, 12, 5)  # two of them share no slot: the scheduler refills
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=9, seed=3, ignore_eos=True)
    completions = engine.generate(requests, params)
    layers, top_k = engine.decoder.routing_shape
    assert top_k == engine.model.config.get_text_config().num_experts_per_tok
    for request, completion in zip(requests, completions, strict=True):
        routed = completion.routed_experts
        full = torch.cat([request.input_ids, torch.tensor(completion.token_ids)])
        assert routed is not None
        assert routed.shape == (full.numel() - 1, layers, top_k)
        expected = _forward_routing(engine, full[:-1])
        # the order of the k ids is the router's (by weight); compare the sets
        assert torch.equal(routed.sort(-1).values, expected.sort(-1).values)


def test_no_routing_unless_asked():
    torch.manual_seed(0)
    engine = HFEngine(build_model("qwen3.5-moe-tiny"), max_batch_size=2)
    request = GenerateRequest(input_ids=torch.arange(100, 108))
    params = SamplingParams(max_new_tokens=3, seed=0, ignore_eos=True)
    assert engine.generate([request], params)[0].routed_experts is None
