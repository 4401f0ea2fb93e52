"""rewards_math."""
