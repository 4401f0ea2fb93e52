"""Qwen3.5 (dense and MoE) as Glimpse runs it: transformers' classes with our forwards.

As :mod:`vlm_models.qwen3_vl.model`: subclasses that only override methods (parameter names
stay transformers'), and :data:`CLASSES`, the table ``build_model`` applies. Qwen3.5 adds the
gated delta net whose state resets at sample boundaries
(:class:`~vlm_models.linear_attention.PackedGatedDeltaNet`) and has no DeepStack; the MoE router
can replay the engine's experts (:class:`~vlm_models.routing_replay.ReplayRouter`). Its RMSNorm
scales by ``(1 + weight)``, not ``F.rms_norm``'s formula, so it keeps transformers' forward.
"""

from __future__ import annotations

from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

from vlm_models.classes import Swap
from vlm_models.linear_attention import PackedGatedDeltaNet
from vlm_models.patch_embed import GemmPatchEmbed
from vlm_models.routing_replay import ReplayRouter
from vlm_models.sync_free import SyncFreePlaceholderMask
from vlm_models.vision_attention import FusedVisionAttention


# -------------------------------------------------------------------------------- Qwen3.5
class Qwen3_5VisionPatchEmbed(GemmPatchEmbed, dense.Qwen3_5VisionPatchEmbed):
    pass


class Qwen3_5VisionAttention(FusedVisionAttention, dense.Qwen3_5VisionAttention):
    pass


class Qwen3_5GatedDeltaNet(PackedGatedDeltaNet, dense.Qwen3_5GatedDeltaNet):
    pass


class Qwen3_5Model(SyncFreePlaceholderMask, dense.Qwen3_5Model):
    pass


# ---------------------------------------------------------------------------- Qwen3.5-MoE
class Qwen3_5MoeVisionPatchEmbed(GemmPatchEmbed, moe.Qwen3_5MoeVisionPatchEmbed):
    pass


class Qwen3_5MoeVisionAttention(FusedVisionAttention, moe.Qwen3_5MoeVisionAttention):
    pass


class Qwen3_5MoeGatedDeltaNet(PackedGatedDeltaNet, moe.Qwen3_5MoeGatedDeltaNet):
    pass


class Qwen3_5MoeModel(SyncFreePlaceholderMask, moe.Qwen3_5MoeModel):
    pass


class Qwen3_5MoeTopKRouter(ReplayRouter, moe.Qwen3_5MoeTopKRouter):
    pass


#: model_type -> which of transformers' classes run as ours, under which build_model option.
CLASSES: dict[str, tuple[Swap, ...]] = {
    "qwen3_5": (
        Swap("fast_patch_embed", dense.Qwen3_5VisionPatchEmbed, Qwen3_5VisionPatchEmbed),
        Swap("fused_vision_attention", dense.Qwen3_5VisionAttention, Qwen3_5VisionAttention),
        Swap("packed_linear_attention", dense.Qwen3_5GatedDeltaNet, Qwen3_5GatedDeltaNet),
        Swap("sync_free", dense.Qwen3_5Model, Qwen3_5Model),
    ),
    "qwen3_5_moe": (
        Swap("fast_patch_embed", moe.Qwen3_5MoeVisionPatchEmbed, Qwen3_5MoeVisionPatchEmbed),
        Swap("fused_vision_attention", moe.Qwen3_5MoeVisionAttention, Qwen3_5MoeVisionAttention),
        Swap("packed_linear_attention", moe.Qwen3_5MoeGatedDeltaNet, Qwen3_5MoeGatedDeltaNet),
        Swap("sync_free", moe.Qwen3_5MoeModel, Qwen3_5MoeModel),
        Swap("routing_replay", moe.Qwen3_5MoeTopKRouter, Qwen3_5MoeTopKRouter),
    ),
}
