"""Grouped-GEMM experts (``GroupedExperts``) against megatron-core's ``SequentialMLP``.

Both models hold the same perturbed HF weights under the same names; one training-style
forward and backward over real geo3k inputs (packed THD rows, as the trainer runs them) must
give the same loss and the same gradient for every parameter.

Tolerance (float32): the grouped kernel and the per-expert ``mm`` may accumulate each dot
product (64 or 32 terms in the tiny presets) in their own blocking order, a few ulps (~1e-7
relative) per result; through 4 layers, on gradients summed over hundreds of tokens, that
stays within ``rtol=1e-4`` and ``atol=1e-6`` of the largest gradient. Measured on torch 2.14's
CPU kernel (one ``mm`` per group): no difference at all, which nothing guarantees for another
kernel. A wrong routing weight, a swapped gate/up half or a gradient landing on another expert
moves them by orders of magnitude more (the negative control below).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.moe.experts import SequentialMLP

from vlm_models.megatron import (
    Parallelism,
    build_megatron_model,
    initialize_model_parallel,
    load_hf_weights,
)
from vlm_models.megatron.experts import GroupedExperts
from vlm_models.presets import PRESETS, tiny_config

QWEN3_VL_IDS = dict(
    vocab_size=151936,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
PRESET_OVERRIDES = {"qwen3-vl-moe-tiny": {}, "qwen3.5-moe-tiny": QWEN3_VL_IDS}
PRESET_NAMES = [n for n in PRESET_OVERRIDES if n in PRESETS]


@pytest.fixture(scope="module")
def tp1():
    initialize_model_parallel(Parallelism())


def _packed(cu: torch.Tensor) -> PackedSeqParams:
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip


def _loss_and_grads(config, hf_model, inputs, *, grouped: bool):
    model = build_megatron_model(config, Parallelism(), moe_grouped_gemm=grouped).train()
    load_hf_weights(model, hf_model.state_dict())
    experts = [m for m in model.modules() if isinstance(m, SequentialMLP)]
    assert experts and all(isinstance(m, GroupedExperts) == grouped for m in experts)
    thd = dict(inputs["thd"])
    packed = _packed(thd.pop("cu_seqlens"))
    logits = model(**thd, packed_seq_params=packed)[0]
    weights = torch.randn(logits.shape[0], generator=torch.Generator().manual_seed(3))
    loss = (logits.float().logsumexp(-1) * weights).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, loss.detach(), grads


def _counting_grouped_mm():
    """``torch._grouped_mm`` wrapped to count its calls (the grouped path ran, not a fallback)."""
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    return mock.patch.object(torch, "_grouped_mm", counted), calls


@pytest.fixture(scope="module", params=PRESET_NAMES)
def both(request, tp1, tiny_setup, make_hf_model, to_megatron_inputs):
    _, _, batch = tiny_setup
    config = tiny_config(request.param, **PRESET_OVERRIDES[request.param])
    hf_model = make_hf_model(config, seed=7)
    inputs = to_megatron_inputs(config, batch)
    patch, calls = _counting_grouped_mm()
    with patch:
        grouped = _loss_and_grads(config, hf_model, inputs, grouped=True)
        # forward: fc1 and fc2; backward: their input and weight gradients, in every layer
        assert len(calls) == 6 * config.text_config.num_hidden_layers
        sequential = _loss_and_grads(config, hf_model, inputs, grouped=False)
        assert len(calls) == 6 * config.text_config.num_hidden_layers
    return grouped, sequential


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale)


def test_same_parameters_and_names(both):
    (model_g, _, _), (model_s, _, _) = both
    got = {n: p.shape for n, p in model_g.named_parameters()}
    assert got == {n: p.shape for n, p in model_s.named_parameters()}
    assert any(".mlp.experts.local_experts.7.linear_fc1.weight" in n for n in got)


def test_loss_and_every_gradient_match_sequential(both):
    (_, loss_g, grads_g), (_, loss_s, grads_s) = both
    assert torch.allclose(loss_g, loss_s, rtol=1e-5, atol=0)
    assert grads_g.keys() == grads_s.keys()
    experts = [n for n in grads_s if ".local_experts." in n]
    assert len(experts) >= 16  # every expert got tokens and a gradient in both
    scale = max(g.abs().max().item() for g in grads_s.values())
    for name, grad in grads_s.items():
        assert _close(grads_g[name], grad, scale), name
    # negative control: expert 0's gradient is not expert 1's
    name0 = next(n for n in experts if ".local_experts.0.linear_fc1" in n)
    name1 = name0.replace(".local_experts.0.", ".local_experts.1.")
    assert not _close(grads_g[name1], grads_s[name0], scale)


def test_an_expert_without_tokens_gets_a_zero_gradient():
    """The weight gradient of an expert no token reached is zero (not the kernel's leftover
    memory), and the other experts' match per-expert matmuls."""
    from vlm_models.megatron.experts import _GroupedLinear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=gen, requires_grad=True)
    weights = [torch.randn(16, 8, generator=gen, requires_grad=True) for _ in range(3)]
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)
    out = _GroupedLinear.apply(x, offsets, [1], *weights)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    expected = torch.cat([x[:3] @ weights[0].T, x[3:] @ weights[2].T])
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(weights[1].grad, torch.zeros(16, 8))
    assert torch.allclose(weights[0].grad, grad[:3].T @ x[:3].detach(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(weights[2].grad, grad[3:].T @ x[3:].detach(), rtol=1e-6, atol=1e-6)
