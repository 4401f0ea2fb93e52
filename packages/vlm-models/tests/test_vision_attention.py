"""The fused vision attention is chosen by the module's layout, whatever its dtype."""

from __future__ import annotations

import torch

from vlm_models import build_model, tiny_config
from vlm_models.vision_attention import _vision_attention_forward, fuse_vision_attention


def test_bf16_tower_is_fused_like_float32():
    """The Megatron model's tower is built in bf16 on the GPU; a probe that compared bf16
    outputs at float32 tolerances refused it (seen on the H200: 0 of 24 fused)."""
    model = build_model(tiny_config()).to(torch.bfloat16)
    tower = model.model.visual
    assert fuse_vision_attention(tower) == tiny_config().vision_config.depth
    fused = [
        m
        for m in tower.modules()
        if getattr(m.forward, "__func__", None) is _vision_attention_forward
    ]
    assert len(fused) == tiny_config().vision_config.depth
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())  # the probe left it as it was
