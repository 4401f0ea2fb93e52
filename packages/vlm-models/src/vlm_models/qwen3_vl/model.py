"""Qwen3-VL (dense and MoE) as Glimpse runs it: transformers' classes with our forwards.

Each class below subclasses transformers' class of the same name and only overrides methods
(no parameters, buffers or submodules added), so parameter names, checkpoints and weight sync
are transformers'. :data:`CLASSES` is the table ``build_model`` applies (see
:func:`vlm_models.classes.select_classes`): the option that turns a row on, transformers'
class, ours. What each forward does and why lives with its mixin:

- patch embedding as one GEMM (:class:`~vlm_models.patch_embed.GemmPatchEmbed`);
- vision attention with bf16 rotary, all images in one varlen kernel
  (:class:`~vlm_models.vision_attention.FusedVisionAttention`);
- RMSNorm as ``F.rms_norm`` (:class:`~vlm_models.rms_norm.FusedRMSNorm`);
- the placeholder mask and the DeepStack merge without host syncs
  (:class:`~vlm_models.sync_free.SyncFreePlaceholderMask`,
  :class:`~vlm_models.sync_free.SyncFreeDeepstack`);
- the MoE router replaying the engine's experts (:class:`~vlm_models.routing_replay.ReplayRouter`).
"""

from __future__ import annotations

from transformers.models.qwen3_vl import modeling_qwen3_vl as dense
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as moe

from vlm_models.classes import Swap
from vlm_models.patch_embed import GemmPatchEmbed
from vlm_models.rms_norm import FusedRMSNorm
from vlm_models.routing_replay import ReplayRouter
from vlm_models.sync_free import SyncFreeDeepstack, SyncFreePlaceholderMask
from vlm_models.vision_attention import FusedVisionAttention


# ------------------------------------------------------------------------------- Qwen3-VL
class Qwen3VLVisionPatchEmbed(GemmPatchEmbed, dense.Qwen3VLVisionPatchEmbed):
    pass


class Qwen3VLVisionAttention(FusedVisionAttention, dense.Qwen3VLVisionAttention):
    pass


class Qwen3VLTextRMSNorm(FusedRMSNorm, dense.Qwen3VLTextRMSNorm):
    pass


class Qwen3VLTextModel(SyncFreeDeepstack, dense.Qwen3VLTextModel):
    pass


class Qwen3VLModel(SyncFreePlaceholderMask, dense.Qwen3VLModel):
    pass


# --------------------------------------------------------------------------- Qwen3-VL-MoE
class Qwen3VLMoeVisionPatchEmbed(GemmPatchEmbed, moe.Qwen3VLMoeVisionPatchEmbed):
    pass


class Qwen3VLMoeVisionAttention(FusedVisionAttention, moe.Qwen3VLMoeVisionAttention):
    pass


class Qwen3VLMoeTextRMSNorm(FusedRMSNorm, moe.Qwen3VLMoeTextRMSNorm):
    pass


class Qwen3VLMoeTextModel(SyncFreeDeepstack, moe.Qwen3VLMoeTextModel):
    pass


class Qwen3VLMoeModel(SyncFreePlaceholderMask, moe.Qwen3VLMoeModel):
    pass


class Qwen3VLMoeTextTopKRouter(ReplayRouter, moe.Qwen3VLMoeTextTopKRouter):
    pass


#: model_type -> which of transformers' classes run as ours, under which build_model option.
CLASSES: dict[str, tuple[Swap, ...]] = {
    "qwen3_vl": (
        Swap("fast_patch_embed", dense.Qwen3VLVisionPatchEmbed, Qwen3VLVisionPatchEmbed),
        Swap("fused_vision_attention", dense.Qwen3VLVisionAttention, Qwen3VLVisionAttention),
        Swap("fused_rms_norm", dense.Qwen3VLTextRMSNorm, Qwen3VLTextRMSNorm),
        Swap("sync_free", dense.Qwen3VLTextModel, Qwen3VLTextModel),
        Swap("sync_free", dense.Qwen3VLModel, Qwen3VLModel),
    ),
    "qwen3_vl_moe": (
        Swap("fast_patch_embed", moe.Qwen3VLMoeVisionPatchEmbed, Qwen3VLMoeVisionPatchEmbed),
        Swap("fused_vision_attention", moe.Qwen3VLMoeVisionAttention, Qwen3VLMoeVisionAttention),
        Swap("fused_rms_norm", moe.Qwen3VLMoeTextRMSNorm, Qwen3VLMoeTextRMSNorm),
        Swap("sync_free", moe.Qwen3VLMoeTextModel, Qwen3VLMoeTextModel),
        Swap("sync_free", moe.Qwen3VLMoeModel, Qwen3VLMoeModel),
        Swap("routing_replay", moe.Qwen3VLMoeTextTopKRouter, Qwen3VLMoeTextTopKRouter),
    ),
}
