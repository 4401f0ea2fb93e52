"""Qwen3.5 and Qwen3.5-MoE as they run here: see :mod:`vlm_models.qwen3_5.model`."""
