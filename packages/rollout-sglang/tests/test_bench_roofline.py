"""The byte and FLOP counts of ``tools/bench/roofline.py`` against hand-computed values for tiny
configs (vocabulary cut to 1000 so the sums stay readable), and against built models' weights.
The fractions of the limits (``harness.roofline``) and the table: ``tests/test_bench_harness.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from vlm_models.build import build_model
from vlm_models.presets import PRESETS, preset_config

_PATH = Path(__file__).resolve().parents[3] / "tools" / "bench" / "roofline.py"
_spec = importlib.util.spec_from_file_location("bench_roofline", _PATH)
assert _spec is not None and _spec.loader is not None
roofline = importlib.util.module_from_spec(_spec)
sys.modules["bench_roofline"] = roofline
_spec.loader.exec_module(roofline)

needs_qwen3_5 = pytest.mark.skipif(
    "qwen3.5-moe-tiny" not in PRESETS, reason="transformers without Qwen3.5"
)


def test_expected_experts() -> None:
    assert roofline.expected_experts(8, 2, 1) == pytest.approx(2.0)  # one token: its top-k
    assert roofline.expected_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert roofline.expected_experts(8, 2, 10_000) == pytest.approx(8.0)  # every expert
    assert roofline.expected_experts(0, 0, 4) == 0.0


def test_mean_live_tokens() -> None:
    # rows of 10 and 20 prompt tokens, 8 new tokens: steps attend P+1 .. P+7, mean P + 4
    assert roofline.mean_live_tokens([10, 20], 8) == pytest.approx(38.0)


def test_qwen3_vl_moe_tiny_by_hand() -> None:
    """h 64, 4 layers, 4 heads / 2 KV heads of 32, 8 experts of 32 (top-2), untied head."""
    config = preset_config("qwen3-vl-moe-tiny", vocab_size=1000)
    attention = 64 * 4 * 32 + 2 * 64 * 2 * 32 + 4 * 32 * 64  # q, k+v, o: 24576
    router, expert, head = 64 * 8, 3 * 64 * 32, 64 * 1000
    # batch 1 hits its 2 experts; batch 4 hits 8 (1 - 0.75^4) = 5.46875
    one = 4 * (attention + router + 2 * expert) + head + 64
    four = 4 * (attention + router + 5.46875 * expert) + head + 4 * 64
    assert one == 213568
    assert roofline.decode_weight_params(config, 1) == pytest.approx(one)
    assert roofline.decode_weight_params(config, 4) == pytest.approx(four)
    # KV: 4 layers x (K, V) x 2 heads x 32 x 2 bytes x 100 live positions
    step = roofline.decode_step_bytes(config, 2, 100, dtype_bytes=2)
    assert step["kv"] == 4 * 2 * 2 * 32 * 2 * 100 == 102400
    assert step["states"] == 0
    assert step["total"] == pytest.approx(2 * roofline.decode_weight_params(config, 2) + 102400)
    # prefill of one 10-token prompt: 2 x (active - head) x 10 + 2 x head + causal attention
    body = 4 * (attention + router + 2 * expert)
    flops = 2 * body * 10 + 2 * head + 4 * (4 * 4 * 32 * 55)
    assert flops == 3230720
    assert roofline.prefill_flops(config, [10]) == pytest.approx(flops)


@needs_qwen3_5
def test_qwen3_5_moe_tiny_by_hand() -> None:
    """3 gated-delta-net layers then 1 gated full-attention layer (2 heads / 1 KV head of 64),
    8 experts of 32 (top-2) and a gated shared expert of 32 per layer."""
    config = preset_config("qwen3.5-moe-tiny", vocab_size=1000)
    full = 64 * 2 * 64 * 2 + 2 * 64 * 1 * 64 + 2 * 64 * 64  # gated q, k+v, o: 32768
    # qkv (key dim 2x16, value dim 4x16), z, b + a, out, depthwise conv over 128 channels x 4
    linear = 64 * 128 + 64 * 64 + 2 * 64 * 4 + 64 * 64 + 4 * 128
    assert linear == 17408
    moe = 64 * 8 + 2 * 3 * 64 * 32 + (3 * 64 * 32 + 64)  # router, 2 experts, shared + its gate
    assert roofline.decode_weight_params(config, 1) == pytest.approx(
        3 * linear + full + 4 * moe + 64 * 1000 + 64
    )
    step = roofline.decode_step_bytes(config, 3, 100, dtype_bytes=2)
    assert step["kv"] == 1 * 2 * 1 * 64 * 2 * 100  # one full-attention layer
    # per linear layer and row, read + written: fp32 state 4 x 16 x 16, conv 128 x 3 (bf16)
    assert step["states"] == 3 * 3 * 2 * (4 * 16 * 16 * 4 + 128 * 3 * 2)
    # prefill: the recurrence costs 4 x v_heads x k_dim x v_dim per token and linear layer
    body = 3 * linear + full + 4 * moe
    flops = 2 * body * 10 + 2 * 64 * 1000 + 4 * 2 * 64 * 55 + 3 * 4 * (4 * 16 * 16) * 10
    assert roofline.prefill_flops(config, [10]) == pytest.approx(flops)


@pytest.mark.parametrize(
    "preset",
    [
        "qwen3-vl-tiny",
        "qwen3-vl-moe-tiny",
        pytest.param("qwen3.5-tiny", marks=needs_qwen3_5),
        pytest.param("qwen3.5-moe-tiny", marks=needs_qwen3_5),
    ],
)
def test_weights_match_built_model(preset: str) -> None:
    """With every expert hit, a step's weights are the language model's matrices (the input
    embedding counted as the rows read; a tied head is the embedding, read whole)."""
    config = preset_config(preset, vocab_size=1000)
    model = build_model(config, dtype=torch.float32)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    matrices = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.ndim >= 2 and "visual" not in name and (tied or "embed_tokens" not in name)
    )
    batch = 10_000  # routing hits every expert
    counted = roofline.decode_weight_params(config, batch) - batch * config.text_config.hidden_size
    assert counted == pytest.approx(matrices)
