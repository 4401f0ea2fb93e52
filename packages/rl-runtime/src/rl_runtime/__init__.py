"""rl_runtime."""
