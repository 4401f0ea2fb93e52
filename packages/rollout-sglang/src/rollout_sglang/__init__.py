"""rollout_sglang."""
