"""Qwen3-VL and Qwen3-VL-MoE as they run here: see :mod:`vlm_models.qwen3_vl.model`."""
