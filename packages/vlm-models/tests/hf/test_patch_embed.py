import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from vlm_models.build import build_model, vision_tower
from vlm_models.classes import select_classes
from vlm_models.patch_embed import Conv3dPatchEmbed, GemmPatchEmbed, LinearPatchEmbed

PATCH_DIM = 3 * 2 * 16 * 16


def _conv(dim: int = 48, dtype=torch.float32) -> nn.Conv3d:
    torch.manual_seed(0)
    return nn.Conv3d(3, dim, kernel_size=(2, 16, 16), stride=(2, 16, 16)).to(dtype)


def test_linear_equals_conv3d_in_float32():
    conv = _conv()
    x = torch.randn(257, PATCH_DIM)
    ref, ours = Conv3dPatchEmbed(conv)(x), LinearPatchEmbed(conv)(x)
    assert ours.shape == ref.shape == (257, 48)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # summation order only


def test_linear_is_as_close_as_conv3d_in_bfloat16():
    conv32 = _conv()
    conv16 = _conv(dtype=torch.bfloat16)
    x = torch.randn(512, PATCH_DIM)
    exact = Conv3dPatchEmbed(conv32)(x.bfloat16().float())
    conv_err = (Conv3dPatchEmbed(conv16)(x).float() - exact).abs().max()
    ours = LinearPatchEmbed(conv16)(x)
    assert ours.dtype == torch.bfloat16
    lin_err = (ours.float() - exact).abs().max()
    assert lin_err <= 2 * conv_err + 1e-2
    torch.testing.assert_close(ours, Conv3dPatchEmbed(conv16)(x), rtol=2e-2, atol=2e-2)


def test_gradients_match():
    conv = _conv(16)
    x = torch.randn(64, PATCH_DIM)
    grads = []
    for module in (Conv3dPatchEmbed(conv), LinearPatchEmbed(conv)):
        conv.zero_grad()
        (module(x) ** 2).sum().backward()
        grads.append((conv.weight.grad.clone(), conv.bias.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-4)


def test_rejects_a_conv_that_is_not_a_patchify():
    with pytest.raises(ValueError, match="kernel == stride"):
        LinearPatchEmbed(nn.Conv3d(3, 8, kernel_size=(2, 16, 16), stride=(1, 8, 8)))


def test_state_dict_layout_is_unchanged_and_toggles_back(samples):
    fast = build_model("qwen3-vl-tiny", fast_patch_embed=True)
    slow = build_model("qwen3-vl-tiny", fast_patch_embed=False)
    assert isinstance(vision_tower(fast).patch_embed, GemmPatchEmbed)
    assert not isinstance(vision_tower(slow).patch_embed, GemmPatchEmbed)
    fast_sd, slow_sd = fast.state_dict(), slow.state_dict()
    assert list(fast_sd) == list(slow_sd)
    assert all(fast_sd[k].shape == slow_sd[k].shape for k in fast_sd)
    assert fast_sd["model.visual.patch_embed.proj.weight"].shape == (32, 3, 2, 16, 16)

    sample = samples[2]
    visual = vision_tower(fast)
    with torch.no_grad():
        ours = visual(sample["pixel_values"], grid_thw=sample["image_grid_thw"]).pooler_output
        assert select_classes(fast, fast_patch_embed=False)["fast_patch_embed"] == 0
        assert type(visual.patch_embed) is type(vision_tower(slow).patch_embed)  # transformers'
        assert not isinstance(visual.patch_embed, GemmPatchEmbed)
        ref = visual(sample["pixel_values"], grid_thw=sample["image_grid_thw"]).pooler_output
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip(tmp_path, samples):
    torch.manual_seed(1)
    model = build_model("qwen3-vl-tiny").eval()
    model.save_pretrained(tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    saved = {k: v for f in files for k, v in load_file(f).items()}
    assert saved["model.visual.patch_embed.proj.weight"].shape == (32, 3, 2, 16, 16)
    assert not any("patch_embed" in k and "proj" not in k for k in saved)

    with torch.no_grad():
        ref = model(**samples[0]).logits
        for fast in (True, False):  # a checkpoint saved by either form loads into both
            loaded = build_model(tmp_path, fast_patch_embed=fast).eval()
            torch.testing.assert_close(loaded(**samples[0]).logits, ref)
