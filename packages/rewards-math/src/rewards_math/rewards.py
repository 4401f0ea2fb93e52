"""Reward functions ``(response, answer) -> float``, one per reward, and a registry by name.

Each reward reads the last boxed answer of the response and compares it with the ground truth.
A response without a boxed answer scores 0. Nothing here raises on any response or answer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from rewards_math.equivalence import is_equivalent
from rewards_math.extract import extract_boxed

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


def math_reward(response: str, answer: str) -> float:
    """1.0 when the last boxed answer is mathematically equal to ``answer``, else 0.0."""
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    return 1.0 if is_equivalent(pred, answer) else 0.0


def geo3k_reward(response: str, answer: str, *, tolerance: float = 0.0) -> float:
    """As ``math_reward``, and also accepts numbers with |pred - gt| <= tolerance * max(1, |gt|).

    Geometry3K labels are often rounded (``7.1`` for ``5\\sqrt{2}``); the reference recipes
    document ``tolerance=0.05`` and ``0.0`` (which makes this ``math_reward``).
    """
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    return 1.0 if is_equivalent(pred, answer, tolerance=tolerance) else 0.0


def deepscaler_reward(response: str, answer: str) -> float:
    """The DeepScaleR rule (slime's ``--rm-type deepscaler``, the reward of its Qwen3.5 geo3k
    run): only the text after the last ``</think>`` counts (or after ``###Response``, that
    dataset's other prompt format); a response that never finishes thinking scores 0. Then as
    ``math``; a ground truth written as ``\\boxed{...}`` is compared by its content."""
    if not isinstance(response, str) or not isinstance(answer, str) or not answer.strip():
        return 0.0
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 2)[1]
    else:
        return 0.0
    gold = extract_boxed(answer) if ("\\boxed" in answer or "\\fbox" in answer) else answer
    return math_reward(solution, gold) if gold is not None else 0.0


def format_score(response: str, *, require_think: bool = False) -> float:
    """1.0 when the response is well formed: a closed boxed answer, after a ``<think>`` block
    (``<think>...</think>`` at the start) when ``require_think``."""
    if not isinstance(response, str):
        return 0.0
    if require_think:
        text = response.lstrip()
        close = text.rfind("</think>")
        if not text.startswith("<think>") or close == -1:
            return 0.0
        response = text[close:]
    return 1.0 if extract_boxed(response) is not None else 0.0


def math_format_reward(
    response: str,
    answer: str,
    *,
    format_weight: float = 0.1,
    tolerance: float = 0.0,
    require_think: bool = False,
) -> float:
    """EasyR1-style ``(1 - w) * accuracy + w * format``.

    Non-binary: a group whose answers are all wrong but well formed gets rewards such as 0.1,
    which float32 cannot hold exactly; GRPO normalisation then sees spurious non-zero
    advantages unless it handles equal rewards exactly. Prefer ``math`` for training.
    """
    accuracy = geo3k_reward(response, answer, tolerance=tolerance)
    fmt = format_score(response, require_think=require_think)
    return (1.0 - format_weight) * accuracy + format_weight * fmt


REWARDS: dict[str, Callable[..., float]] = {
    "math": math_reward,
    "geo3k": geo3k_reward,
    "math_format": math_format_reward,
    "deepscaler": deepscaler_reward,
}
"""Rewards by name. Register your own with ``REWARDS["name"] = fn``."""


def build(reward_type: str = "math", **kwargs: float | bool) -> RewardFn:
    """A ``(response, answer) -> float`` callable for the reward named ``reward_type``.

    ``kwargs`` are that reward's keyword options (``tolerance``, ``format_weight``...). An unknown
    name or option raises ``ValueError`` here, once, at configuration time, never while scoring.
    The result is a ``functools.partial``, so it pickles into worker processes.
    """
    try:
        fn = REWARDS[reward_type]
    except KeyError:
        raise ValueError(
            f"unknown reward_type {reward_type!r}; choose one of {sorted(REWARDS)}"
        ) from None
    fn_kwargs = fn.__kwdefaults__ or {}
    unknown = sorted(set(kwargs) - set(fn_kwargs))
    if unknown:
        raise ValueError(f"reward {reward_type!r} takes options {sorted(fn_kwargs)}, not {unknown}")
    return functools.partial(fn, **kwargs)


def _reward_kwargs(reward_type: str, tolerance: float) -> dict[str, float]:
    if not tolerance:
        return {}
    if reward_type == "math":
        raise ValueError('reward_type "math" is strict; use "geo3k" for a numeric tolerance')
    return {"tolerance": tolerance}


def compute_score(
    response: str, answer: str, *, reward_type: str = "math", tolerance: float = 0.0
) -> float:
    """Score one response against its ground-truth answer (see ``REWARDS`` for the types)."""
    return build(reward_type, **_reward_kwargs(reward_type, tolerance))(response, answer)
