"""geo3k_sft launcher."""
