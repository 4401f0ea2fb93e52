"""rewards_math: verifiable math rewards for RL on reasoning data. No torch.

>>> from rewards_math import compute_score
>>> compute_score("... so x = \\\\boxed{4\\\\sqrt{2}}", "\\\\sqrt { 32 }")
1.0

The settings (`RewardConfig`) import here; every other name is imported from its module on
first use (PEP 562 `__getattr__`).
"""

from __future__ import annotations

import importlib
from typing import Any

from rewards_math.config import RewardConfig

#: Each public name not imported above, by the module that defines it.
_LAZY: dict[str, tuple[str, ...]] = {
    "rewards_math.batch": ("BatchScorer", "score_batch"),
    "rewards_math.equivalence": ("is_equivalent",),
    "rewards_math.extract": ("extract_boxed", "has_boxed"),
    "rewards_math.normalize": ("canonical",),
    "rewards_math.rewards": (
        "REWARDS",
        "RewardFn",
        "build",
        "compute_score",
        "deepscaler_reward",
        "format_score",
        "geo3k_reward",
        "math_format_reward",
        "math_reward",
    ),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = ["RewardConfig"]
__all__ += sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
