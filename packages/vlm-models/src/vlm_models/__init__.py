"""vlm_models: Qwen3-VL / Qwen3.5 through transformers, with a fast vision path.

Builders (:func:`build_model`, :func:`tiny_config`); the model files
(``vlm_models.qwen3_vl.model``, ``vlm_models.qwen3_5.model``: subclasses of transformers'
classes with our forwards, which ``build_model`` selects through :func:`select_classes`);
packed M-RoPE position ids, parameter and FLOP counts, weight sync. Megatron modules live in
``vlm_models.megatron`` and are not imported here.

Only the launcher's settings import here (`ModelConfig`, `ModelSourceError`): the rest imports
transformers (seconds) and is imported from its module (``from vlm_models.build import
build_model``), so a launcher parses its flags without it.
"""

from vlm_models.config import SUPPORTED_MODELS, TINY_MODEL, ModelConfig, ModelSourceError

__all__ = ["SUPPORTED_MODELS", "TINY_MODEL", "ModelConfig", "ModelSourceError"]
