"""rewards_math: verifiable math rewards for RL on reasoning data. No torch.

>>> from rewards_math import compute_score
>>> compute_score("... so x = \\\\boxed{4\\\\sqrt{2}}", "\\\\sqrt { 32 }")
1.0
"""

from rewards_math.batch import BatchScorer, score_batch
from rewards_math.config import RewardConfig
from rewards_math.equivalence import is_equivalent
from rewards_math.extract import extract_boxed, has_boxed
from rewards_math.normalize import canonical
from rewards_math.rewards import (
    REWARDS,
    RewardFn,
    build,
    compute_score,
    deepscaler_reward,
    format_score,
    geo3k_reward,
    math_format_reward,
    math_reward,
)

__all__ = [
    "REWARDS",
    "BatchScorer",
    "RewardConfig",
    "RewardFn",
    "build",
    "canonical",
    "compute_score",
    "deepscaler_reward",
    "extract_boxed",
    "format_score",
    "geo3k_reward",
    "has_boxed",
    "is_equivalent",
    "math_format_reward",
    "math_reward",
    "score_batch",
]
