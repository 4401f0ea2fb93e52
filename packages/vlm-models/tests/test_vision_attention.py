"""The fused vision attention is chosen by the module's layout, whatever its dtype."""

from __future__ import annotations

import torch

from vlm_models.build import build_model
from vlm_models.classes import select_classes
from vlm_models.presets import tiny_config
from vlm_models.vision_attention import FusedVisionAttention


def test_bf16_tower_is_fused_like_float32():
    """The Megatron model's tower is built in bf16 on the GPU; a probe that compared bf16
    outputs at float32 tolerances refused it (seen on the H200: 0 of 24 fused)."""
    model = build_model(tiny_config()).to(torch.bfloat16)
    tower = model.model.visual
    depth = tiny_config().vision_config.depth
    assert select_classes(tower, fused_vision_attention=True)["fused_vision_attention"] == depth
    fused = [m for m in tower.modules() if isinstance(m, FusedVisionAttention)]
    assert len(fused) == depth
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())  # the probe left it as it was
