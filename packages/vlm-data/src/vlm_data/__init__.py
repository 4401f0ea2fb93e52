"""vlm_data: image+question datasets into model-ready Qwen3-VL prompts (rollout, training, SFT).

Only the launcher's settings import here (`DataConfig`, `TEMPLATES`): the rest imports
transformers (seconds) and is imported from its module (``from vlm_data.prompts import
PromptBuilder``), so a launcher parses its flags without it.
"""

from vlm_data.config import SYNTHETIC, TEMPLATES, DataConfig

__all__ = ["SYNTHETIC", "TEMPLATES", "DataConfig"]
