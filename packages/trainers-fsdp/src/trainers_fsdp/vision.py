"""The Qwen3-VL vision tower without host syncs or per-image kernels in its forward.

:class:`VisionInputs` computes the tower's per-patch inputs on the host when a micro-batch is
built; :func:`fuse_vision_attention` runs all images in one varlen kernel with bf16 rotary. Both
live in vlm_models (the Megatron model's vision tower uses them too) and are re-exported here.
"""

from vlm_models.vision_attention import fuse_vision_attention
from vlm_models.vision_inputs import VisionInputs

__all__ = ["VisionInputs", "fuse_vision_attention"]
