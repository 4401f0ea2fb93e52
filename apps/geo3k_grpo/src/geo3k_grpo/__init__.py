"""geo3k_grpo launcher."""
