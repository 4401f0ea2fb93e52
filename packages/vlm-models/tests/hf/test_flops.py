import pytest
import torch
from torch import nn
from transformers import AutoModelForImageTextToText

from vlm_models.build import build_model, vision_tower
from vlm_models.flops import (
    count_parameters,
    flops_per_token,
    lm_matmul_params,
    parameter_counts,
    vision_flops,
    vision_matmul_params_per_patch,
)
from vlm_models.presets import SHAPE_PRESETS, TINY_PRESETS, preset_config

# the slime recipe's Qwen3.5 MoE, where transformers has Qwen3.5
QWEN35 = ["qwen3.5-35b-a3b"] if "qwen3.5-35b-a3b" in SHAPE_PRESETS else []


def _meta_model(config):
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def _matmul_weights(module: nn.Module) -> int:
    """Weights that multiply activations: every >= 2-D parameter outside embedding tables
    (Linear and Conv weights, routers, fused expert tensors)."""
    total = 0
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if p.ndim >= 2 and not isinstance(owner, nn.Embedding):
            total += p.numel()
    return total


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-vl-2b",
        "qwen3-vl-4b",
        "qwen3-vl-8b",
        "qwen3-vl-30b-a3b",
        *QWEN35,
        *sorted(TINY_PRESETS),
    ],
)
def test_matmul_counts_equal_the_built_modules(name):
    config = preset_config(name)
    model = _meta_model(config)
    lm = model.model.language_model
    lm_head = model.config.text_config.hidden_size * model.config.text_config.vocab_size
    assert lm_matmul_params(config, active=False) == _matmul_weights(lm) + lm_head

    vc = config.vision_config
    visual = vision_tower(model)
    per_patch = vision_matmul_params_per_patch(config)
    merge = vc.spatial_merge_size**2
    mergers = sum(
        _matmul_weights(m) for m in visual.modules() if type(m).__name__.endswith("PatchMerger")
    )
    others = _matmul_weights(visual) - mergers
    assert per_patch == pytest.approx(others + mergers / merge)


@pytest.mark.parametrize(
    "name", ["qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", *QWEN35, "qwen3-vl-tiny"]
)
def test_parameter_counts_from_the_config_equal_the_built_model(name):
    """The memory estimate's counts: exact for dense shapes, within 0.1% for MoE."""
    config = preset_config(name)
    built = count_parameters(_meta_model(config))
    counts = parameter_counts(config)
    assert counts["vision"] == built["vision"]
    assert counts["language"] == pytest.approx(
        built["language"], rel=0 if "a3b" not in name else 1e-3
    )
    assert counts["total"] == counts["language"] + counts["vision"]


def test_moe_counts_only_routed_experts_as_active():
    cfg = preset_config("qwen3-vl-30b-a3b")
    total, active = lm_matmul_params(cfg, active=False), lm_matmul_params(cfg, active=True)
    assert 29e9 < total < 31e9  # "30B"
    assert 2.5e9 < active < 3.5e9  # "A3B"


@pytest.mark.parametrize("name", QWEN35)
def test_qwen35_35b_a3b_is_35b_with_3b_active(name):
    cfg = preset_config(name)
    assert 34.5e9 < parameter_counts(cfg)["total"] < 36e9  # "35B"
    assert 2.5e9 < lm_matmul_params(cfg, active=True) < 3.5e9  # "A3B"


def test_flops_per_token_follow_the_convention():
    cfg = preset_config("qwen3-vl-4b")
    tc = cfg.text_config
    slope = 3 * 4 * tc.num_hidden_layers * tc.num_attention_heads * tc.head_dim
    f1, f2 = flops_per_token(cfg, 1024), flops_per_token(cfg, 2048)
    assert f2 - f1 == slope * 1024
    assert f1 - slope * 1024 == 6 * lm_matmul_params(cfg)
    assert flops_per_token(cfg, 1024, training=False) * 3 == f1


def test_vision_flops_scale_with_images():
    cfg = preset_config("qwen3-vl-4b")
    one = vision_flops(cfg, [[1, 32, 32]])
    assert vision_flops(cfg, torch.tensor([[1, 32, 32], [1, 32, 32]])) == pytest.approx(2 * one)
    assert vision_flops(cfg, [[1, 32, 32]], training=False) == pytest.approx(one / 3)
    assert one > 2 * 1024 * 3 * vision_matmul_params_per_patch(cfg)  # attention adds on top
    # Two frames attend separately: twice one frame, not a 2048-patch attention.
    assert vision_flops(cfg, [[2, 32, 32]]) == pytest.approx(2 * one)


def test_count_parameters_splits_towers():
    model = build_model("qwen3-vl-moe-tiny", freeze_vision=True)
    counts = count_parameters(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["vision"] == sum(p.numel() for p in vision_tower(model).parameters())
    assert counts["trainable"] == counts["language"]
    h, v = model.config.text_config.hidden_size, model.config.text_config.vocab_size
    assert counts["embedding"] == 2 * h * v  # untied: input embedding + lm_head
    tied = count_parameters(build_model("qwen3-vl-tiny"))
    assert tied["embedding"] == h * v
