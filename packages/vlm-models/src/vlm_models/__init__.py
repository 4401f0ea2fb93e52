"""vlm_models."""
