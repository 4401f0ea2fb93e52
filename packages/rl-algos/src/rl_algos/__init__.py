"""rl_algos."""
