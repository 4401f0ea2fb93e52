"""Reward functions, the registry, build() and compute_score()."""

import pickle

import pytest

from rewards_math import (
    REWARDS,
    build,
    compute_score,
    deepscaler_reward,
    format_score,
    geo3k_reward,
    math_format_reward,
    math_reward,
)

RESPONSE = "The legs are 4 and 4, so the hypotenuse is $\\boxed{4\\sqrt{2}}$."


def test_math_reward_is_binary():
    assert math_reward(RESPONSE, "\\sqrt { 32 }") == 1.0
    assert math_reward(RESPONSE, "5.66") == 0.0
    assert math_reward("the answer is 4\\sqrt{2}", "\\sqrt{32}") == 0.0  # no boxed answer
    assert math_reward("\\boxed{3} no wait \\boxed{5}", "5") == 1.0  # the last box counts


def test_geo3k_tolerance():
    assert geo3k_reward("\\boxed{5.66}", "4\\sqrt{2}", tolerance=0.05) == 1.0
    assert geo3k_reward("\\boxed{5.66}", "4\\sqrt{2}", tolerance=0.0) == 0.0
    assert geo3k_reward("\\boxed{7}", "4\\sqrt{2}", tolerance=0.05) == 0.0


def test_format_weighted_variant():
    assert math_format_reward(RESPONSE, "\\sqrt{32}") == pytest.approx(1.0)
    assert math_format_reward("\\boxed{1}", "\\sqrt{32}") == pytest.approx(0.1)
    assert math_format_reward("no box", "\\sqrt{32}") == 0.0
    assert math_format_reward("\\boxed{1}", "2", format_weight=0.5) == pytest.approx(0.5)
    thinking = "<think>4^2+4^2=32</think> so \\boxed{\\sqrt{32}}"
    assert math_format_reward(thinking, "4\\sqrt{2}", require_think=True) == pytest.approx(1.0)
    assert math_format_reward(RESPONSE, "4\\sqrt{2}", require_think=True) == pytest.approx(0.9)


def test_format_score():
    assert format_score("<think>a</think>\\boxed{1}", require_think=True) == 1.0
    assert format_score("\\boxed{1}<think>a</think>", require_think=True) == 0.0
    assert format_score("<think>a \\boxed{1}</think> done", require_think=True) == 0.0
    assert format_score("\\boxed{1}") == 1.0


def test_deepscaler_counts_only_the_answer_after_thinking():
    """slime's Qwen3.5 geo3k run scores with this rule (rm_hub/deepscaler.py)."""
    finished = "<think>legs 4 and 4, \\boxed{5}?</think> The hypotenuse is \\boxed{4\\sqrt{2}}."
    assert deepscaler_reward(finished, "\\sqrt{32}") == 1.0
    assert deepscaler_reward(finished, "\\boxed{\\sqrt{32}}") == 1.0  # a boxed label: its content
    assert deepscaler_reward(finished, "5") == 0.0  # a box inside the thinking does not count
    unfinished = "<think>legs 4 and 4, so \\boxed{4\\sqrt{2}}"
    assert deepscaler_reward(unfinished, "\\sqrt{32}") == 0.0  # no </think>: no reward
    assert deepscaler_reward(RESPONSE, "\\sqrt{32}") == 0.0  # no thinking at all
    assert deepscaler_reward("<think>a</think> it is 4", "4") == 0.0  # no boxed answer
    assert deepscaler_reward("<think>a</think> \\boxed{4}", "") == 0.0  # no label
    assert deepscaler_reward("q ###Response \\boxed{4}", "4") == 1.0  # the dataset's other format
    assert deepscaler_reward(None, "4") == 0.0  # type: ignore[arg-type]
    assert build("deepscaler")(finished, "4\\sqrt{2}") == 1.0


def test_registry_and_build():
    assert set(REWARDS) >= {"math", "geo3k", "math_format", "deepscaler"}
    reward = build("geo3k", tolerance=0.05)
    assert reward("\\boxed{5.66}", "4\\sqrt{2}") == 1.0
    restored = pickle.loads(pickle.dumps(reward))  # travels to worker processes and Ray actors
    assert restored("\\boxed{5.66}", "4\\sqrt{2}") == 1.0
    assert build("math")(RESPONSE, "\\sqrt{32}") == 1.0
    with pytest.raises(ValueError, match="unknown reward_type"):
        build("nope")
    with pytest.raises(ValueError, match="takes options"):
        build("math", tolerance=0.1)


def test_compute_score():
    assert compute_score(RESPONSE, "\\sqrt{32}") == 1.0
    assert compute_score("\\boxed{5.66}", "4\\sqrt{2}", reward_type="geo3k", tolerance=0.05) == 1.0
    assert compute_score("\\boxed{5.66}", "4\\sqrt{2}", reward_type="geo3k") == 0.0
    with pytest.raises(ValueError, match="strict"):
        compute_score(RESPONSE, "1", reward_type="math", tolerance=0.05)


def test_deterministic():
    responses = [RESPONSE, "\\boxed{5.66}", "\\boxed{x=3}", "junk \\boxed{\\frac{1}{0}}"]
    first = [compute_score(r, "4\\sqrt{2}") for r in responses]
    for _ in range(3):
        assert [compute_score(r, "4\\sqrt{2}") for r in responses] == first


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("\\boxed{1,234,567}", "1234567"),
        ("\\boxed{14{,}916}", "14916"),
        ("\\boxed{11,\\! 111,\\! 100}", "11111100"),
        ("\\boxed{-1{,}000.5}", "-1000.5"),
        ("\\boxed{\\$1,234}", "1234"),
        ("\\boxed{1234567}", "1,234,567"),
    ],
)
def test_thousands_separators_are_one_number(response, gold):
    assert compute_score(response, gold) == 1.0


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("\\boxed{(1, 2)}", "12", 0.0),
        ("\\boxed{(1,234)}", "1234", 0.0),  # a pair in parentheses stays a pair
        ("\\boxed{1, 234}", "1234", 0.0),  # a space after the comma: two answers
        ("\\boxed{1,2}", "12", 0.0),  # not groups of three digits
    ],
)
def test_tuples_stay_tuples(response, gold, expected):
    assert compute_score(response, gold) == expected
