"""vlm_data."""
