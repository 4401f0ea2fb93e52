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
