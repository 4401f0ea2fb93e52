"""The Qwen3-VL vision tower without host syncs in its forward.

:class:`VisionInputs` computes the tower's per-patch inputs on the host when a micro-batch is
built (the fused vision attention of ``build_model(fused_vision_attention=True)`` takes its
``max_seqlen`` from them). It lives in vlm_models (the Megatron model's vision tower uses it
too) and is re-exported here.
"""

from vlm_models.vision_inputs import VisionInputs

__all__ = ["VisionInputs"]
