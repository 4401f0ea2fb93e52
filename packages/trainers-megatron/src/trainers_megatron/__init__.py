"""trainers_megatron."""
