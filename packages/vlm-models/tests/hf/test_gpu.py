"""CUDA checks (skipped without a GPU): bf16 patch embedding and flash-attention packing."""

import importlib.util

import pytest
import torch

from vlm_models.build import build_model
from vlm_models.packing import packed_inputs
from vlm_models.patch_embed import Conv3dPatchEmbed, LinearPatchEmbed

pytestmark = pytest.mark.gpu


def test_patch_embed_bf16_on_cuda():
    conv = torch.nn.Conv3d(3, 1024, (2, 16, 16), stride=(2, 16, 16)).cuda().bfloat16()
    x = torch.randn(16384, 1536, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        LinearPatchEmbed(conv)(x), Conv3dPatchEmbed(conv)(x), rtol=2e-2, atol=2e-2
    )


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_packed_forward_with_flash_attention(samples):
    torch.manual_seed(0)
    model = build_model(
        "qwen3-vl-tiny",
        dtype=torch.bfloat16,
        attn_implementation="flash_attention_2",
        device="cuda",
    ).eval()
    cuda = [{k: v.cuda() for k, v in s.items()} for s in samples]
    inputs = packed_inputs(
        [s["input_ids"][0] for s in cuda],
        config=model.config,
        pixel_values=[s.get("pixel_values") for s in cuda],
        image_grid_thw=[s.get("image_grid_thw") for s in cuda],
    )
    cu = inputs.pop("cu_seqlens").tolist()
    with torch.no_grad():
        packed = model(**inputs).logits[0].float()
        for s, start, end in zip(cuda, cu[:-1], cu[1:], strict=True):
            alone = model(**s).logits[0].float()
            torch.testing.assert_close(packed[start:end], alone, rtol=3e-2, atol=3e-2)


def _delta_rule_float64(q, k, v, g, beta):
    """The gated delta rule token by token in float64, q/k L2-normalised, q scaled by
    ``K ** -0.5`` (``[B, T, H, *]`` layout, as fla's ``chunk_gated_delta_rule`` takes)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = torch.nn.functional.normalize(q, dim=-1) * q.shape[-1] ** -0.5
    k = torch.nn.functional.normalize(k, dim=-1)
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")
def test_fla_delta_rule_on_float32_inputs_tracks_the_float64_rule():
    """Why every side gives the chunked delta rule float32 q/k/v
    (``vlm_models.linear_attention.use_float32_delta_rule``): fla keeps its chunk states and dots
    in the inputs' dtype. From the same bf16 values, float32 inputs follow the float64 rule
    at least twice as close as bf16 inputs, forward and backward (the backward on Hopper runs
    fla's tilelang path where Triton 3.4-3.7.0 is installed)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    torch.manual_seed(0)
    b, t, h, d = 1, 512, 32, 128  # the 35B-A3B cut's value heads and head size; 8 chunks
    q, k, v = (torch.randn(b, t, h, d, device="cuda").bfloat16() for _ in range(3))
    g = -torch.nn.functional.softplus(torch.randn(b, t, h, device="cuda")) * 0.1
    beta = torch.rand(b, t, h, device="cuda").bfloat16()
    weight = torch.randn(b, t, h, d, device="cuda", dtype=torch.float64)

    def run(dtype):
        x = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v)]
        out, _ = chunk_gated_delta_rule(*x, g=g, beta=beta.to(dtype), use_qk_l2norm_in_kernel=True)
        (out.double() * weight).sum().backward()
        return out.double(), x[2].grad.double()

    ref_x = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _delta_rule_float64(*ref_x, g, beta)
    (ref * weight).sum().backward()
    ref_dv = ref_x[2].grad

    def error(got, want):
        return ((got - want).abs().mean() / want.abs().mean()).item()

    (o16, dv16), (o32, dv32) = run(torch.bfloat16), run(torch.float32)
    errors = {
        "out_bf16": error(o16, ref),
        "out_f32": error(o32, ref),
        "dv_bf16": error(dv16, ref_dv),
        "dv_f32": error(dv32, ref_dv),
    }
    print("relative error against the float64 rule:", errors)
    assert errors["out_f32"] < errors["out_bf16"] / 2, errors
    assert errors["dv_f32"] < errors["dv_bf16"] / 2, errors
    assert errors["out_f32"] < 1e-2 and errors["dv_f32"] < 1e-2, errors
