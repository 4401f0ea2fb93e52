"""The log-prob microscope's engine side (``rollout_sglang.hf.microscope``) on the tiny Qwen3.5
MoE preset in float32: the engine's teacher-forced decode agrees with transformers' forward to
float32 rounding, and a fault planted in one place of the decode step is named there (the first
layer and part that differ), not later where it spreads."""

from __future__ import annotations

import pytest
import torch

from rollout_sglang.hf import decode as decode_module
from rollout_sglang.hf import linear_attention_decode as lad
from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.hf.microscope import GDN_PARTS, Trace, compare, decode_trace, forward_trace
from rollout_sglang.types import GenerateRequest, SamplingParams
from vlm_models.build import build_model

PART_AT = 1e-4  # float32 paths agree to ~1e-6 relative (measured 1.6e-7 to 1.6e-6)


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    model = build_model("qwen3.5-moe-tiny")
    engine = HFEngine(model, max_batch_size=4)
    gen = torch.Generator().manual_seed(0)
    requests = [
        GenerateRequest(input_ids=torch.randint(100, 5000, (n,), generator=gen))
        for n in (9, 14, 14)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=0, ignore_eos=True)
    responses = [c.token_ids for c in engine.generate(requests, params)]
    forward = [forward_trace(engine, r, t) for r, t in zip(requests, responses, strict=True)]
    return engine, requests, responses, forward


def test_teacher_forced_decode_agrees_with_the_forward(sampled):
    engine, requests, responses, forward = sampled
    decoded = decode_trace(engine, requests, responses)
    result = compare(decoded, forward, part_at=PART_AT)
    assert result["mean_gap"] < 1e-5, result
    assert result["parts_at"] is None, result
    layers = engine.decoder.text.layers
    assert [row["layer"] for row in result["layers"]] == list(range(len(layers)))
    for i in engine.decoder.linear_layers:  # every gated-delta-net part was compared
        assert set(GDN_PARTS) <= set(result["layers"][i]), result["layers"][i]
    for trace, response in zip(decoded, responses, strict=True):
        assert len(trace.logprobs) == len(response)
        assert all(h.shape[0] == len(response) - 1 for h in trace.hidden)


def test_engine_logprobs_are_the_decode_paths(sampled):
    """The engine's own sampled log-probs are the teacher-forced decode's (same step, same
    tokens): the microscope's decode path is the one the rollout takes."""
    engine, requests, responses, _ = sampled
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=0, ignore_eos=True)
    completions = engine.generate(requests, params)
    assert [c.token_ids for c in completions] == responses
    rollout = [Trace(logprobs=torch.tensor(c.logprobs)) for c in completions]
    assert (
        compare(rollout, decode_trace(engine, requests, responses), part_at=PART_AT)["mean_gap"]
        < 1e-6
    )


def _no_decay(q, k, v, g, beta, state):
    """The delta rule with the decay left out: a fault inside the recurrence."""
    return lad.torch_recurrent_step(q, k, v, torch.zeros_like(g), beta, state)


def test_a_fault_in_the_recurrence_is_named_at_its_layer(sampled, monkeypatch):
    engine, requests, responses, forward = sampled
    monkeypatch.setattr(lad, "recurrent_step", _no_decay)
    result = compare(decode_trace(engine, requests, responses), forward, part_at=PART_AT)
    first = engine.decoder.linear_layers[0]
    assert result["parts_at"]["layer"] == first, result["parts_at"]
    assert result["parts_at"]["what"] == "recurrent", result["parts_at"]
    assert result["layers"][first]["conv"] < PART_AT  # the conv before it still agrees
    assert result["mean_gap"] > 1e-4


def test_a_fault_in_the_attention_layer_is_named_there(sampled, monkeypatch):
    """Rotary left out of the decode step's gated attention: the gated-delta-net layers before
    it agree, the first attention layer is where the paths part."""
    engine, requests, responses, forward = sampled
    monkeypatch.setattr(decode_module, "_rotate", lambda x, cos, sin: x)
    result = compare(decode_trace(engine, requests, responses), forward, part_at=PART_AT)
    first_attention = engine.decoder.kv_layers[0]
    assert result["parts_at"] == {
        "layer": first_attention,
        "what": "hidden",
        "relative": result["layers"][first_attention]["hidden"],
    }
    assert all(result["layers"][i]["hidden"] < PART_AT for i in range(first_attention))


def test_replaying_the_forwards_routing_takes_the_flips_out(sampled, monkeypatch):
    """A router that picks other experts than the model's (a planted flip in every token):
    the microscope counts every token of every MoE layer rerouted; with the forward's routing
    replayed the decode takes the same experts and agrees with the forward again."""
    from rollout_sglang.hf import moe

    real = moe.route

    def flipped(x, weight, top_k, renormalise, ids=None):
        if ids is None:  # the lowest-scored experts instead of the top ones
            ids = torch.topk(-torch.nn.functional.linear(x, weight), top_k, dim=-1).indices
        return real(x, weight, top_k, renormalise, ids=ids)

    monkeypatch.setattr(moe, "route", flipped)
    engine, requests, responses, forward = sampled
    result = compare(decode_trace(engine, requests, responses), forward, part_at=PART_AT)
    moe_layers = [row for row in result["layers"] if "rerouted" in row]
    assert moe_layers and all(row["rerouted"] == 1.0 for row in moe_layers)
    assert result["mean_gap"] > 1e-3
    replayed = decode_trace(engine, requests, responses, replay=forward)
    result = compare(replayed, forward, part_at=PART_AT)
    assert all(row["rerouted"] == 0.0 for row in result["layers"] if "rerouted" in row)
    assert result["mean_gap"] < 1e-5 and result["parts_at"] is None


def test_the_decode_conv_rounds_as_the_forwards_conv1d_does():
    """The decode step's causal conv (one window per slot) against ``F.conv1d``, which the
    prefill and the trainers run, in bf16: products summed in float32 and rounded once agree
    with it but for float32 summation order (measured: every element equal on a CPU); rounding
    each product to bf16 first, as the step did, moved 36 % of the elements by a bf16 step."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model("qwen3.5-tiny", dtype=torch.bfloat16)
    attn = next(
        m.linear_attn for m in model.model.language_model.layers if hasattr(m, "linear_attn")
    )
    batch = 64
    x = torch.randn(batch, model.config.text_config.hidden_size, dtype=torch.bfloat16)
    state = torch.randn(batch, attn.conv_dim, attn.conv_kernel_size, dtype=torch.bfloat16)
    window = torch.cat((state[:, :, 1:], F.linear(x, attn.in_proj_qkv.weight)[:, :, None]), -1)
    expected = F.conv1d(window, attn.conv1d.weight, attn.conv1d.bias, groups=attn.conv_dim)
    expected = F.silu(expected)[..., 0]
    trace: dict[str, torch.Tensor] = {}
    recurrent = torch.zeros(batch, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim)
    lad.gated_delta_net_step(attn, x, state.clone(), recurrent, trace=trace)
    differ = trace["conv"] != expected
    assert differ.float().mean() < 0.01
    ulp = expected.float().abs() * 2**-7  # one bf16 step at each value
    assert ((trace["conv"].float() - expected.float()).abs() <= ulp + 1e-6).all()
