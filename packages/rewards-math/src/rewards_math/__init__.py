"""rewards_math: verifiable math rewards for RL on reasoning data. No torch.

>>> from rewards_math import compute_score
>>> compute_score("... so x = \\\\boxed{4\\\\sqrt{2}}", "\\\\sqrt { 32 }")
1.0

The settings (`RewardConfig`) import here; every other name is imported from its module on
first use (`lazy_loader.attach`, PEP 562).
"""

from __future__ import annotations

import lazy_loader

from rewards_math.config import RewardConfig

# every public name not imported above is imported from its module on first use
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "batch": ["BatchScorer", "score_batch"],
        "equivalence": ["is_equivalent"],
        "extract": ["extract_boxed", "has_boxed"],
        "normalize": ["canonical"],
        "rewards": [
            "REWARDS",
            "RewardFn",
            "build",
            "compute_score",
            "deepscaler_reward",
            "format_score",
            "geo3k_reward",
            "math_format_reward",
            "math_reward",
        ],
    },
)
__all__ += ["RewardConfig"]
