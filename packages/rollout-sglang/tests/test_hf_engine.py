"""The transformers engine, for real on CPU: tiny Qwen3-VL, real processor, real geo3k images."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.hf.sampling import counter_uniform, filter_top_k_top_p
from rollout_sglang.types import Completion, GenerateRequest, RolloutEngine, SamplingParams
from weight_sync import iter_weight_buckets


@pytest.fixture(scope="module")
def engine(tiny_model):
    # 3 slots for 4 requests: the 4th waits for a free slot (continuous batching)
    return HFEngine(tiny_model, max_batch_size=3)


def greedy(n: int = 5, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


def test_generation_reproducible_by_seed(engine, requests_):
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=7)
    first = engine.generate(requests_, params)
    again = engine.generate(requests_, params)
    other = engine.generate(requests_, SamplingParams(temperature=1.0, max_new_tokens=5, seed=8))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    for c, r in zip(first, requests_, strict=True):
        assert c.ok and c.finish_reason == "length" and c.response_length == 5
        assert c.prompt_length == r.prompt_length and c.request_id == r.request_id


def _forward_logprobs(model, request: GenerateRequest, completion: Completion, temperature: float):
    """Log-probs of the response under a plain forward of the whole sequence, the model computing
    its own M-RoPE positions (an independent path from the engine's)."""
    response = torch.tensor(completion.token_ids)
    input_ids = torch.cat([request.input_ids, response])[None]
    types = torch.cat([request.mm_token_type_ids, torch.zeros_like(response)])[None]
    with torch.no_grad():
        logits = (
            model(
                input_ids=input_ids,
                pixel_values=request.pixel_values,
                image_grid_thw=request.image_grid_thw,
                mm_token_type_ids=types,
            )
            .logits[0]
            .float()
        )
    start = request.prompt_length - 1
    scores = logits[start : start + len(response)] / (temperature or 1.0)
    return scores.log_softmax(-1).gather(-1, response[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=6, seed=0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=6, seed=0),
    ],
    ids=["t1.0", "t0.7-topk-topp"],
)
def test_logprobs_equal_a_forward_pass(engine, tiny_model, requests_, params):
    # 4 prompts of different lengths at batch size 3: left padding and two batches are exercised
    completions = engine.generate(requests_, params)
    for request, completion in zip(requests_, completions, strict=True):
        expected = _forward_logprobs(tiny_model, request, completion, params.temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_matmul_decode_attention_logprobs_equal_a_forward_pass(tiny_model, requests_):
    engine = HFEngine(tiny_model, max_batch_size=2, decode_attention="matmul")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
    for request, completion in zip(requests_, engine.generate(requests_, params), strict=True):
        expected = _forward_logprobs(tiny_model, request, completion, params.temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_shared_prompt_logprobs_equal_a_forward_pass(engine, tiny_model, requests_):
    # one prompt three times (a GRPO group): prefilled once, its K/V copied to three slots
    same = [copy.copy(requests_[0]) for _ in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    completions = engine.generate(same, params)
    assert len({tuple(c.token_ids) for c in completions}) > 1  # rows sampled independently
    for request, completion in zip(same, completions, strict=True):
        expected = _forward_logprobs(tiny_model, request, completion, params.temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_batched_equals_one_by_one(engine, requests_):
    batched = engine.generate(requests_, greedy())
    alone = [engine.generate([r], greedy())[0] for r in requests_]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]


def test_greedy_equals_model_generate(engine, tiny_model, requests_):
    n = 6
    ours = engine.generate(requests_[:2], greedy(n, ignore_eos=True))
    for request, completion in zip(requests_[:2], ours, strict=True):
        with torch.no_grad():
            out = tiny_model.generate(
                input_ids=request.input_ids[None],
                attention_mask=torch.ones_like(request.input_ids)[None],
                pixel_values=request.pixel_values,
                image_grid_thw=request.image_grid_thw,
                mm_token_type_ids=request.mm_token_type_ids[None],
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        assert completion.token_ids == out[0, request.prompt_length :].tolist()


def _redraw(model, request, prefix: list[int], params: SamplingParams) -> tuple[int, float]:
    """The engine's draw for token ``len(prefix)`` of ``request`` redone under a plain forward of
    the prompt and ``prefix``: the token, and how far the draw lands from the nearest
    cumulative-probability boundary."""
    response = torch.tensor(prefix, dtype=torch.long)
    input_ids = torch.cat([request.input_ids, response])[None]
    types = torch.cat([request.mm_token_type_ids, torch.zeros_like(response)])[None]
    with torch.no_grad():
        logits = (
            model(
                input_ids=input_ids,
                pixel_values=request.pixel_values,
                image_grid_thw=request.image_grid_thw,
                mm_token_type_ids=types,
            )
            .logits[0, -1]
            .float()
        )
    scaled = (logits / params.temperature)[None]
    probs = filter_top_k_top_p(scaled, params.top_k, params.top_p).softmax(-1)[0]
    cdf = probs.cumsum(-1)
    target = counter_uniform(torch.tensor([request.seed]), torch.tensor([len(prefix)]))[0] * cdf[-1]
    return int(torch.searchsorted(cdf, target, right=True)), float((cdf - target).abs().min())


def test_continuous_batching_equals_one_at_a_time_when_sampling(tiny_model, requests_):
    """8 sampled requests (4 prompts twice, per-request seeds) through 2 slots: requests join as
    others finish, in other slots and at other steps than alone.

    What the engine guarantees is that a request's uniforms depend on its seed and token index
    only; its logits in a batch equal those alone to float32 rounding (other kernels' blocking,
    not bit for bit: on an AMD EPYC CPU a draw over the full 151k vocabulary landed 1 id away).
    So the draw is over the top 16 tokens, whose cumulative probabilities are ~1/16 apart, and a
    token may differ only where the uniform falls within 1e-4 of a boundary (logit rounding
    moves a boundary by ~1e-6), which a plain forward of the shared prefix checks.
    """
    many = [copy.copy(r) for r in requests_ + requests_]
    params = SamplingParams(temperature=1.0, top_k=16, max_new_tokens=5, seed=11)
    for i, r in enumerate(many):
        r.seed = 100 + i
    two_slots = HFEngine(tiny_model, max_batch_size=2)
    batched = two_slots.generate(many, params)
    stats = two_slots.last_stats  # where the call's time went: 8 requests, 2 at a time
    assert stats["requests"] == 8 and stats["prefills"] >= 4
    assert stats["decode_steps"] >= 8 * 4 / 2  # 4 decoded tokens each (the first: prefill)
    assert 0 < stats["prefill_s"] + stats["decode_s"] <= stats["seconds"]
    assert stats["graph_captures"] == 0  # CPU: eager steps
    assert stats["decode_device_s"] == 0  # CUDA events only: no device clock on a CPU
    alone = [HFEngine(tiny_model, max_batch_size=1).generate([r], params)[0] for r in many]
    ids = alone[0].token_ids  # the redraw reproduces the engine's draws
    assert [_redraw(tiny_model, many[0], ids[:t], params)[0] for t in range(5)] == ids
    same = 0
    for request, a, b in zip(many, batched, alone, strict=True):
        if a.token_ids == b.token_ids:
            same += 1
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            continue
        t = next(
            i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y
        )
        _, margin = _redraw(tiny_model, request, a.token_ids[:t], params)
        assert margin < 1e-4, (request.seed, t, margin)
    assert same >= 6  # a boundary within 1e-4 is a ~3e-3 chance per draw
    # the same prompt with another seed samples differently
    assert batched[0].token_ids != batched[4].token_ids


def test_seed_defaults_to_base_plus_position(engine, requests_):
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5)
    both = engine.generate(requests_[:2], params)
    second = copy.copy(requests_[1])
    second.seed = 6  # what position 1 of a seed-5 call gets
    assert engine.generate([second], params)[0].token_ids == both[1].token_ids


def test_finished_sequences_free_their_slots_and_the_rest_compact(tiny_model, requests_):
    engine = HFEngine(tiny_model, max_batch_size=4)
    moves = []
    original = engine._move
    engine._move = lambda src, dst: (moves.append((src, dst)), original(src, dst))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1, ignore_eos=True)
    free = engine.generate(requests_, params)
    # requests 0 and 1 stop at their 2nd token; 2 and 3 run on and move to slots 0, 1
    stops = (free[0].token_ids[1], free[1].token_ids[1])
    assert not any(t in c.token_ids for t in stops for c in free[2:])
    stopped = engine.generate(
        requests_, SamplingParams(**{**vars(params), "stop_token_ids": stops})
    )
    assert [c.finish_reason for c in stopped] == ["stop", "stop", "length", "length"]
    assert [c.response_length for c in stopped[:2]] == [2, 2]
    for before, after in zip(free, stopped, strict=True):
        n = after.response_length
        assert after.token_ids == before.token_ids[:n]
        assert after.logprobs == pytest.approx(before.logprobs[:n], abs=1e-5)
    assert moves, "the two live sequences should have moved to the front"


def test_request_larger_than_the_cache_fails_alone(tiny_model, requests_):
    shortest = min(requests_, key=lambda r: r.prompt_length)
    engine = HFEngine(tiny_model, cache_tokens=shortest.prompt_length + 3, max_batch_size=2)
    out = engine.generate(requests_, greedy(4))
    fits = [r.prompt_length + 3 <= shortest.prompt_length + 3 for r in requests_]
    assert [c.ok for c in out] == fits
    for i, c in enumerate(out):
        assert c.ok or ("KV-cache tokens" in c.error and f"request {i}" in c.error)


def test_legacy_decode_setting_uses_the_transformers_loop():
    from vlm_models.build import build_model

    torch.manual_seed(0)
    model = build_model("qwen3.5-tiny")  # in the decode step, but legacy asked for
    assert HFEngine(model)._legacy is None
    engine = HFEngine(model, legacy_decode=True)
    assert engine._legacy is not None
    text_only = [GenerateRequest(input_ids=torch.arange(100, 100 + n)) for n in (5, 9)]
    out = engine.generate(text_only, greedy(3))
    assert all(c.ok and c.response_length == 3 for c in out)


def test_stop_token_ends_one_request_and_pruning_keeps_the_others(engine, requests_):
    free = engine.generate(requests_, greedy(6))
    stop_id = free[0].token_ids[2]
    stopped = engine.generate(requests_, greedy(6, stop_token_ids=(stop_id,)))
    first = free[0].token_ids.index(stop_id) + 1
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == free[0].token_ids[:first]  # the stop id is kept
    assert len(stopped[0].logprobs) == first
    for before, after in zip(free[1:], stopped[1:], strict=True):
        if stop_id in before.token_ids:
            continue
        assert after.finish_reason == "length" and after.token_ids == before.token_ids
        assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)


def test_ignore_eos(tiny_model, requests_):
    probe = HFEngine(tiny_model)
    first = probe.generate(requests_[:1], greedy(3))[0].token_ids[0]
    as_eos = HFEngine(tiny_model, eos_token_ids=[first])
    assert as_eos.generate(requests_[:1], greedy(3))[0].token_ids == [first]
    kept = as_eos.generate(requests_[:1], greedy(3, ignore_eos=True))[0]
    assert kept.response_length == 3 and kept.finish_reason == "length"


def test_bad_requests_fail_alone(tiny_model, requests_):
    engine = HFEngine(tiny_model, max_batch_size=8, max_prompt_length=60)
    good = [r for r in requests_ if r.prompt_length <= 60][:2]
    long = next(r for r in requests_ if r.prompt_length > 60)
    empty = GenerateRequest(input_ids=torch.zeros(0, dtype=torch.long), request_id="empty")
    image_id = tiny_model.config.image_token_id
    short_of_tokens = copy.copy(good[0])
    keep = torch.ones_like(good[0].input_ids, dtype=torch.bool)
    keep[(good[0].input_ids == image_id).nonzero()[0]] = False  # one image placeholder removed
    short_of_tokens.input_ids = good[0].input_ids[keep]
    no_pixels = copy.copy(good[1])
    no_pixels.pixel_values = None
    batch = [good[0], empty, long, short_of_tokens, no_pixels, good[1]]

    out = engine.generate(batch, greedy(3))

    assert [c.ok for c in out] == [True, False, False, False, False, True]
    assert "empty prompt" in out[1].error and "empty" in out[1].error
    assert "more than the limit 60" in out[2].error
    assert "image tokens" in out[3].error and "request 3" in out[3].error
    assert "no pixel_values" in out[4].error
    assert all(c.finish_reason == "error" and c.token_ids == [] for c in out[1:5])
    alone = engine.generate(good, greedy(3))
    assert [out[0].token_ids, out[5].token_ids] == [c.token_ids for c in alone]


def test_max_new_tokens_clipped_to_context(tiny_model, requests_):
    request = requests_[0]
    engine = HFEngine(tiny_model)
    engine.context_length = request.prompt_length + 2  # as if the model's context were that short
    out = engine.generate([request], greedy(10))[0]
    assert out.response_length == 2 and out.finish_reason == "length"


def test_weight_update_changes_outputs_and_restores(requests_):
    from vlm_models.build import build_model
    from vlm_models.presets import tiny_config

    torch.manual_seed(1)
    model = build_model(tiny_config())
    engine = HFEngine(model)
    original = {n: t.detach().clone() for n, t in model.state_dict().items()}
    before = engine.generate(requests_, greedy(4))

    torch.manual_seed(2)
    perturbed = {
        n: t + 0.5 * torch.randn_like(t) for n, t in original.items() if t.is_floating_point()
    }
    engine.update_weights(iter_weight_buckets(perturbed.items(), bucket_bytes=1 << 20))
    patch = "model.visual.patch_embed.proj.weight"
    assert model.get_parameter(patch).shape == perturbed[patch].shape  # 5-D, GEMM patch embed
    torch.testing.assert_close(model.get_parameter(patch), perturbed[patch])
    after = engine.generate(requests_, greedy(4))
    assert [c.token_ids for c in after] != [c.token_ids for c in before]

    engine.update_weights(iter_weight_buckets(original.items(), bucket_bytes=1 << 20))
    restored = engine.generate(requests_, greedy(4))
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]


def test_weight_update_rejects_unknown_names_and_shapes(tiny_model):
    engine = HFEngine(tiny_model)
    with pytest.raises(KeyError, match=r"not\.a\.weight"):
        engine.update_weights([[("not.a.weight", torch.zeros(1))]])
    with pytest.raises(ValueError, match="expects"):
        engine.update_weights([[("lm_head.weight", torch.zeros(3, 3))]])
    # same element count, other layout: refused rather than loaded scrambled
    weight = tiny_model.get_parameter("model.language_model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="expects"):
        engine.update_weights([[("model.language_model.layers.0.mlp.down_proj.weight", weight.T)]])


def test_weight_update_accepts_a_flat_patch_embedding():
    from vlm_models.build import build_model
    from vlm_models.presets import tiny_config

    model = build_model(tiny_config())
    name = "model.visual.patch_embed.proj.weight"
    param = model.get_parameter(name)
    flat = torch.randn(param.shape[0], param[0].numel())  # a Linear-style export
    HFEngine(model).update_weights([[(name, flat)]])
    torch.testing.assert_close(param.detach(), flat.view(param.shape))


def test_release_and_resume_memory(tiny_model, requests_):
    engine = HFEngine(tiny_model)
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(requests_[:1], greedy(1))
    engine.resume_memory()
    assert engine.health()
    assert engine.generate(requests_[:1], greedy(1))[0].ok


def test_weights_dropped_at_release_come_back_only_by_a_push(requests_):
    """Without a host backup the release frees the weights; resumed, the engine refuses to
    generate until a push rewrote every parameter (naming one it lacks), then generates as
    before the release."""
    from vlm_models.build import build_model
    from vlm_models.presets import tiny_config

    torch.manual_seed(1)
    model = build_model(tiny_config())
    engine = HFEngine(model, weights_backup=False)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    before = engine.generate(requests_, greedy(4))
    engine.release_memory()
    assert all(p.numel() == 0 for p in model.parameters())
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="dropped at release_memory"):
        engine.generate(requests_[:1], greedy(1))
    last = list(dict(model.named_parameters()))[-1]  # a parameter, not a buffer
    partial = [(n, t) for n, t in weights.items() if n != last]
    engine.update_weights(iter_weight_buckets(partial, bucket_bytes=1 << 20))
    with pytest.raises(RuntimeError, match=r"1 of \d+ parameters"):
        engine.generate(requests_[:1], greedy(1))
    engine.update_weights(iter_weight_buckets(weights.items(), bucket_bytes=1 << 20))
    after = engine.generate(requests_, greedy(4))
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    engine.release_memory()  # again: dropped again, refilled again
    engine.resume_memory()
    engine.update_weights(iter_weight_buckets(weights.items(), bucket_bytes=1 << 20))
    assert [c.token_ids for c in engine.generate(requests_, greedy(4))] == [
        c.token_ids for c in before
    ]


def test_a_released_cache_is_sized_anew_from_what_is_free():
    """Colocated, the cache is released while the trainer steps and taken again at the next
    rollout; the trainer's optimizer state (allocated at its first step) may by then hold what
    the first rollout's cache had. The budget is asked again at that allocate (on the H200, a
    fixed 34.5 GiB cache could not come back beside 113.6 GiB of Megatron state)."""
    from rollout_sglang.hf.kv_cache import KVCache

    budgets = iter([8192, 4096, 1024])
    cache = KVCache(
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        budget_tokens=lambda: next(budgets),
    )
    assert cache.fit(512, 64) and (cache.budget_tokens, cache.slots) == (8192, 16)
    cache.allocate()  # no release in between: nothing is asked
    assert cache.budget_tokens == 8192
    cache.release()
    assert cache.fit(512, 64) and (cache.budget_tokens, cache.slots) == (4096, 8)
    cache.release()
    assert cache.fit(512, 64) and (cache.budget_tokens, cache.slots) == (1024, 2)
    assert cache.keys is not None and cache.keys.shape == (2, 2, 2, 512, 8)
