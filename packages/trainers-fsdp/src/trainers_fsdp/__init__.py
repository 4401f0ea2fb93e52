"""trainers_fsdp."""
