"""Every recipe family through the engine's decode step (CPU, float32): Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5, Qwen3.5-MoE tiny presets.

Qwen3-VL presets take the real processor's geo3k prompts (images through prefill); the Qwen3.5
presets have other image-token ids than that processor, so they take text prompts, two of equal
length (one prefill group) and two of others (a group each)."""

from __future__ import annotations

import pytest
import torch

from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.hf.moe import experts_dense, experts_grouped, moe_forward, route
from rollout_sglang.types import Completion, GenerateRequest, SamplingParams
from vlm_models.build import build_model
from vlm_models.weights import to_wire_layout
from weight_sync import iter_weight_buckets

PRESETS = ["qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"]


def _requests(preset: str, prompt_samples) -> list[GenerateRequest]:
    if preset.startswith("qwen3-vl"):
        return [GenerateRequest.from_prompt(s) for s in prompt_samples]
    gen = torch.Generator().manual_seed(0)
    return [
        GenerateRequest(input_ids=torch.randint(100, 5000, (n,), generator=gen))
        for n in (9, 14, 14, 23)
    ]


@pytest.fixture(scope="module", params=PRESETS)
def family(request, prompt_samples):
    torch.manual_seed(0)
    model = build_model(request.param)
    return request.param, model, _requests(request.param, prompt_samples)


def _forward_logprobs(model, request: GenerateRequest, completion: Completion) -> torch.Tensor:
    """Teacher-forced log-probs of the response under the model's own forward (T = 1)."""
    response = torch.tensor(completion.token_ids)
    inputs = {"input_ids": torch.cat([request.input_ids, response])[None]}
    if request.pixel_values is not None:
        types = torch.cat([request.mm_token_type_ids, torch.zeros_like(response)])[None]
        inputs.update(
            pixel_values=request.pixel_values,
            image_grid_thw=request.image_grid_thw,
            mm_token_type_ids=types,
        )
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    start = request.prompt_length - 1
    scores = logits[start : start + len(response)]
    return scores.log_softmax(-1).gather(-1, response[:, None]).squeeze(-1)


def _assert_logprobs_match(model, requests, completions) -> None:
    for request, completion in zip(requests, completions, strict=True):
        assert completion.ok, completion.error
        expected = _forward_logprobs(model, request, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_decodes_in_the_engine_with_forward_logprobs(family):
    preset, model, requests = family
    engine = HFEngine(model, max_batch_size=4)
    assert engine._legacy is None, preset
    completions = engine.generate(
        requests, SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
    )
    assert engine.last_stats["decode_steps"] > 0
    assert all(c.response_length == 6 for c in completions)
    _assert_logprobs_match(model, requests, completions)


def test_greedy_four_slots_equal_one_at_a_time(family):
    _, model, requests = family
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    batched = HFEngine(model, max_batch_size=4).generate(requests, params)
    one = HFEngine(model, max_batch_size=1)
    alone = [one.generate([r], params)[0] for r in requests]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    for a, b in zip(batched, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_in_place_weight_update_reaches_the_decode_step(family):
    """The step reads the live parameters: after ``update_weights`` its log-probs are the
    updated model's forward's, and its tokens change."""
    preset, _, requests = family
    torch.manual_seed(1)
    model = build_model(preset)
    engine = HFEngine(model, max_batch_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    before = engine.generate(requests, params)
    torch.manual_seed(2)
    perturbed = {
        n: t + 0.05 * torch.randn_like(t) * t.std().clamp(min=1.0)
        for n, t in model.state_dict().items()
        if t.is_floating_point() and "visual" not in n
    }
    # Sent as a trainer sends them: the checkpoint's layout (vlm_models.weights).
    wire = to_wire_layout(model, perturbed)
    engine.update_weights(iter_weight_buckets(wire.items(), bucket_bytes=1 << 20))
    after = engine.generate(requests, params)
    assert engine.last_stats["decode_steps"] > 0
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    _assert_logprobs_match(model, requests, after)


@pytest.mark.parametrize("preset", ["qwen3-vl-moe-tiny", "qwen3.5-moe-tiny"])
def test_grouped_moe_decode_equals_dense(preset, prompt_samples):
    """The grouped-GEMM experts path (CUDA's) through the whole engine: ``torch._grouped_mm``
    has a CPU implementation here, so the sort / offsets / scatter logic is checked on CPU."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    torch.manual_seed(0)
    model = build_model(preset)
    requests = _requests(preset, prompt_samples)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0)
    grouped = HFEngine(model, max_batch_size=4, decode_moe="grouped")
    assert grouped.decoder.moe_grouped
    _assert_logprobs_match(model, requests, grouped.generate(requests, params))


def _moe_block(preset: str):
    torch.manual_seed(0)
    model = build_model(preset)
    return model.model.language_model.layers[0].mlp


@pytest.mark.parametrize("preset", ["qwen3-vl-moe-tiny", "qwen3.5-moe-tiny"])
def test_moe_forward_equals_the_block(preset):
    mlp = _moe_block(preset)
    x = torch.randn(5, mlp.gate.hidden_dim)
    with torch.no_grad():
        expected = mlp(x[None])[0]
        expected = expected[0] if isinstance(expected, tuple) else expected
        for grouped in (False, True):
            torch.testing.assert_close(
                moe_forward(mlp, x, grouped=grouped), expected, atol=1e-5, rtol=1e-5
            )


def test_grouped_experts_equal_dense_with_empty_experts():
    torch.manual_seed(0)
    experts, hidden, inter, batch, top_k = 6, 16, 8, 3, 2
    gate_up = torch.randn(experts, 2 * inter, hidden)
    down = torch.randn(experts, hidden, inter)
    x = torch.randn(batch, hidden)
    weights, ids = route(x, torch.randn(experts, hidden), top_k, renormalise=True)
    assert len(ids.unique()) < experts  # some experts get no rows
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch))
    dense = experts_dense(x, weights, ids, gate_up, down)
    torch.testing.assert_close(experts_grouped(x, weights, ids, gate_up, down), dense)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_on_cuda_bf16():
    torch.manual_seed(0)
    experts, hidden, inter, batch, top_k = 8, 256, 128, 64, 2
    device = torch.device("cuda")
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) / 16
    down = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) / 16
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    weights, ids = route(
        x, torch.randn(experts, hidden, device=device, dtype=torch.bfloat16), top_k, True
    )
    dense = experts_dense(x.float(), weights.float(), ids, gate_up.float(), down.float())
    grouped = experts_grouped(x, weights, ids, gate_up, down)
    torch.testing.assert_close(grouped.float(), dense, atol=5e-2, rtol=5e-2)


def test_rollout_config_legacy_decode_keeps_the_transformers_loop(tiny_model):
    from rollout_sglang import RolloutConfig, build_engine

    assert build_engine(RolloutConfig(backend="hf"), model=tiny_model)._legacy is None
    legacy = build_engine(RolloutConfig(backend="hf", legacy_decode=True), model=tiny_model)
    assert legacy._legacy is not None


def test_finished_slots_refill_and_compact_with_their_states(family):
    """2 slots for 4 requests, two stopping early: later requests prefill into freed slots and
    live ones move down (K/V and Qwen3.5's per-slot states together); log-probs still equal
    the forward's."""
    _, model, requests = family
    # top-k 16: draws far from a boundary, so 2 slots sample what 4 did (logits round apart)
    params = SamplingParams(temperature=1.0, top_k=16, max_new_tokens=6, seed=5, ignore_eos=True)
    free = HFEngine(model, max_batch_size=4).generate(requests, params)
    stops = tuple({free[0].token_ids[1], free[1].token_ids[1]})
    stopping = SamplingParams(**{**vars(params), "stop_token_ids": stops})
    for slots in (2, 4):
        engine = HFEngine(model, max_batch_size=slots)
        moves: list = []
        original = engine._move
        engine._move = lambda src, dst, o=original, m=moves: (m.append((src, dst)), o(src, dst))
        stopped = engine.generate(requests, stopping)
        assert [c.finish_reason for c in stopped[:2]] == ["stop", "stop"]
        if slots == 2:
            assert engine.last_stats["prefills"] >= 2  # the later requests took freed slots
        else:
            assert moves  # requests 2 and 3 moved down to slots 0 and 1
        _assert_logprobs_match(model, requests, stopped)
