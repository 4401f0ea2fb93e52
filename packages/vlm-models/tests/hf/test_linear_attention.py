"""Qwen3.5 packed rows: the gated-delta-net layers reset their state at sample boundaries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlm_models.build import build_model
from vlm_models.classes import select_classes
from vlm_models.linear_attention import is_linear_attention, linear_attention_packs, varlen_kernels
from vlm_models.packing import (
    cu_seqlens_from_lengths,
    packed_position_ids,
    supports_packed_forward,
    text_position_ids,
)
from vlm_models.presets import PRESETS

pytestmark = pytest.mark.skipif("qwen3.5-tiny" not in PRESETS, reason="needs Qwen3.5")


def _packed_call(samples, config):
    """Keyword arguments of one packed row of ``samples`` and its lengths."""
    ids = [s["input_ids"][0] for s in samples]
    grids = [s.get("image_grid_thw") for s in samples]
    lengths = [int(t.numel()) for t in ids]
    mrope = packed_position_ids(ids, grids, config)
    kwargs = dict(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat([text_position_ids(lengths)[None], mrope])[:, None, :],
        pixel_values=torch.cat([s["pixel_values"] for s in samples if "pixel_values" in s]),
        image_grid_thw=torch.cat([g for g in grids if g is not None]),
        use_cache=False,
    )
    return kwargs, lengths


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_packed_row_equals_each_sample_alone(samples, qwen3_vl_ids, name):
    """transformers' sdpa full attention (boundaries from the text position row) and the
    per-sample gated delta net: each sample's last hidden states in the row equal its own
    forward's (an image sample, then a text-only one)."""
    torch.manual_seed(0)
    model = build_model(name, attn_implementation="sdpa", **qwen3_vl_ids).eval()
    rows = [samples[0], samples[1]]
    kwargs, lengths = _packed_call(rows, model.config)
    inner = model.model  # hidden states: the LM head adds nothing to check, and costs time
    with torch.no_grad():
        before = inner(**kwargs).last_hidden_state[0]  # transformers' forward: samples mix
        assert not supports_packed_forward(model)
        converted = select_classes(model, packed_linear_attention=True)
        assert converted["packed_linear_attention"] == 3  # three linear-attention layers of four
        assert supports_packed_forward(model) and linear_attention_packs(model)
        info = SimpleNamespace(cu_seqlens=cu_seqlens_from_lengths(lengths), lengths=lengths)
        packed = inner(**kwargs, packed_seq_info=info).last_hidden_state[0]
        unchanged = inner(**kwargs).last_hidden_state[0]  # no boundaries: transformers' own
        alone = [inner(**s).last_hidden_state[0] for s in rows]
    torch.testing.assert_close(unchanged, before, rtol=0, atol=0)
    start = 0
    worst_before = 0.0
    for n, ref in zip(lengths, alone, strict=True):
        torch.testing.assert_close(packed[start : start + n], ref, rtol=1e-5, atol=1e-5)
        worst_before = max(worst_before, float((before[start : start + n] - ref).abs().max()))
        start += n
    assert worst_before > 1e-2  # the bug this fixes: without boundaries, samples mix


def test_bad_rows_are_refused_and_cpu_uses_the_per_sample_path(qwen3_vl_ids):
    torch.manual_seed(0)
    model = build_model("qwen3.5-tiny", packed_linear_attention=True, **qwen3_vl_ids).eval()
    again = select_classes(model, packed_linear_attention=True)
    assert again["packed_linear_attention"] == 3  # idempotent: the same three layers
    layer = next(m for m in model.modules() if is_linear_attention(m))
    assert not varlen_kernels(layer)  # no fla / causal_conv1d here: the torch reference path
    hidden = torch.randn(1, 10, model.config.text_config.hidden_size)
    bad = SimpleNamespace(cu_seqlens=cu_seqlens_from_lengths([4, 5]), lengths=(4, 5))
    with pytest.raises(ValueError, match="sum to 9, the row has 10 tokens"):
        layer(hidden, packed_seq_info=bad)
    with pytest.raises(ValueError, match=r"one sequence \(\[1, T, hidden\]\)"):
        layer(hidden.expand(2, -1, -1), packed_seq_info=bad)


def test_kernel_resolution_is_read_from_transformers_own_wrapper():
    """``varlen_kernels`` reads which implementation transformers' hub-kernel fallback picked:
    a function of an importable package (here ``math.sqrt``) is a real kernel, the torch
    reference is not."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    from vlm_models.linear_attention import _real_kernel

    def sqrt(x):
        return x**0.5

    def no_such_kernel(x):
        return x

    picked = use_kernel_func_from_hub_with_fallback("sqrt", "math")(sqrt)
    reference = use_kernel_func_from_hub_with_fallback("no_such_kernel", "math")(no_such_kernel)
    assert picked(4.0) == 2.0 and _real_kernel(picked)
    assert not _real_kernel(reference) and not _real_kernel(sqrt)


def test_a_layer_that_would_not_get_the_boundaries_is_not_packed(qwen3_vl_ids):
    """A decoder layer that calls its linear attention without the forward's keywords would
    never hand it ``packed_seq_info``: that layer is left alone and the model does not pack."""
    model = build_model("qwen3.5-tiny", **qwen3_vl_ids).eval()
    decoder = model.model.language_model.layers[0]

    class WithoutKeywords(type(decoder)):
        def forward(self, hidden_states, **kwargs):
            return self.linear_attn(hidden_states)

    decoder.__class__ = WithoutKeywords
    assert select_classes(model, packed_linear_attention=True)["packed_linear_attention"] == 2
    assert not linear_attention_packs(model) and not supports_packed_forward(model)


def test_the_chunked_delta_rule_gets_float32_inputs_on_every_model_built(qwen3_vl_ids):
    """build_model hands the gated delta net's chunked rule float32 q, k, v and beta (fla keeps
    its chunk states in the inputs' dtype; the engine's decode carries a float32 state), casts
    its output back, and the switch is reversible. The CPU's torch reference computes in float32
    already, so there the outputs are bit-identical with it on and off."""
    from vlm_models.linear_attention import (
        delta_rule_modules,
        float32_inputs,
        use_float32_delta_rule,
    )

    torch.manual_seed(0)
    model = build_model("qwen3.5-moe-tiny", dtype=torch.bfloat16, **qwen3_vl_ids).eval()
    (module,) = delta_rule_modules(model)
    wrapped = module.torch_chunk_gated_delta_rule
    assert getattr(wrapped, "float32_inputs", False)
    assert use_float32_delta_rule(model) == []  # already on: nothing wrapped twice

    seen: list[tuple[torch.dtype, ...]] = []

    def spy(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype, kwargs["beta"].dtype))
        return wrapped.__wrapped__(query, key, value, *args, **kwargs)

    module.torch_chunk_gated_delta_rule = float32_inputs(spy)
    ids = torch.randint(0, 1000, (1, 70))  # two chunks of 64
    try:
        with torch.no_grad():
            on = model.model.language_model(input_ids=ids).last_hidden_state
    finally:
        module.torch_chunk_gated_delta_rule = wrapped
    assert seen and set(seen) == {(torch.float32,) * 4}
    assert on.dtype == torch.bfloat16

    assert use_float32_delta_rule(model, on=False) == [module.__name__]
    try:
        assert not getattr(module.torch_chunk_gated_delta_rule, "float32_inputs", False)
        with torch.no_grad():
            off = model.model.language_model(input_ids=ids).last_hidden_state
    finally:
        use_float32_delta_rule(model)
    torch.testing.assert_close(on, off, rtol=0, atol=0)
    assert getattr(module.torch_chunk_gated_delta_rule, "float32_inputs", False)
