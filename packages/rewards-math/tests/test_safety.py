"""Untrusted responses: nothing is evaluated as code, nothing raises, time stays bounded.

Time is measured and only checked against a generous bound (5 s a call), so the tests do not
flake on a busy machine; the benchmark in tools/bench measures speed.
"""

import string
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards_math import REWARDS, compute_score

GENEROUS_S = 5.0

INJECTIONS = [
    "\\boxed{__import__('os').system('touch PWNED')}",
    '\\boxed{__import__("os").system("touch PWNED")}',
    "\\boxed{exec(\"open('PWNED','w').close()\")}",
    "\\boxed{eval(\"__import__('os').system('touch PWNED')\")}",
    "\\boxed{(lambda: __import__('os').system('touch PWNED'))()}",
    "\\boxed{os.system('touch PWNED')}",
    "\\boxed{1}; __import__('os').system('touch PWNED')",
    "__import__('os').system('touch PWNED') = 2 + 3*4",
]


@pytest.mark.parametrize("response", INJECTIONS)
@pytest.mark.parametrize("reward_type", sorted(REWARDS))
def test_responses_are_never_evaluated(response, reward_type, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for answer in ["0", "1", "14", "\\sqrt{2}", "__import__('os').system('touch PWNED')"]:
        score = compute_score(response, answer, reward_type=reward_type)
        assert 0.0 <= score <= 1.0
    assert not (tmp_path / "PWNED").exists()


def _timed(response: str, answer: str) -> float:
    start = time.perf_counter()
    for reward in REWARDS.values():
        score = reward(response, answer)
        assert isinstance(score, float)
        assert 0.0 <= score <= 1.0
    elapsed = time.perf_counter() - start
    assert elapsed < GENEROUS_S * len(REWARDS)
    return elapsed


ADVERSARIAL = [
    "\\boxed{10^{10^{10}}}",
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{(10^{999})^{999}}",
    "\\boxed{9^{9^{9}}}",
    "\\boxed{2^{2^{2^{2^{2}}}}}",
    "\\boxed{\\exp(\\exp(\\exp(1000)))}",
    "\\boxed{99999999!}",
    "\\boxed{(x+y+z)^{99} - (x+y+z)^{98}}",
    "\\boxed{\\sum_{i=1}^{10^{9}} i}",
    "\\boxed{\\int_0^{\\infty} e^{-x^2} dx}",
    "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "\\boxed{" + "\\sqrt{" * 500 + "2" + "}" * 500 + "}",
    "\\boxed{" + "(" * 500 + "1" + ")" * 500 + "}",
    "\\boxed{" + "1+" * 5000 + "1}",
    "\\boxed{" + "9" * 5000 + "}",
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{0/0}",
    "\\boxed{\\begin{pmatrix}" + "&".join(["x"] * 300) + "\\end{pmatrix}}",
    "\\boxed{\\left(\\right.}",
    "\\boxed{\\\\\\\\}",
    "\\boxed{}}}}",
    "\\boxed{\x00\x01\x02}",
    "\\boxed{😀 ∞ √2}",
    "x" * 100_000 + "\\boxed{5}",
    "\\boxed{5}" * 10_000,
    "{" * 100_000,
    "\\boxed{" * 20_000,
]


@pytest.mark.parametrize("response", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
@pytest.mark.parametrize("answer", ["5", "10^{10}", "\\sqrt{2}", "x + 1"])
def test_adversarial_inputs_are_bounded(response, answer):
    _timed(response, answer)


def test_long_response_with_correct_answer_scores():
    response = "Let me think. " * 8_000 + "\\boxed{\\frac { 40 } { 3 }}"
    assert len(response) > 100_000
    assert compute_score(response, "40/3") == 1.0


def test_non_string_inputs_score_zero():
    for bad in [None, 5, b"\\boxed{5}", ["\\boxed{5}"]]:
        assert compute_score(bad, "5") == 0.0  # type: ignore[arg-type]
        assert compute_score("\\boxed{5}", bad) == 0.0  # type: ignore[arg-type]


LATEXY = st.lists(
    st.sampled_from(
        [
            *string.digits,
            *"+-*/^_{}()[]=<>.,!| xyz",
            *["\\frac", "\\sqrt", "\\pi", "\\circ", "\\text{cm}", "\\cdot", "\\exp", "\\sum", "\\"],
        ]
    ),
    max_size=40,
).map("".join)


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(body=LATEXY, answer=LATEXY)
def test_fuzz_latex_like_answers(body, answer):
    _timed(f"Reasoning... \\boxed{{{body}}}", answer)


@settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(response=st.text(max_size=300), answer=st.text(max_size=40))
def test_fuzz_arbitrary_text(response, answer):
    _timed(response, answer)
    _timed(f"\\boxed{{{response}}}", answer)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    depth=st.integers(0, 3000),
    opener=st.sampled_from(["{", "(", "{1+", "(x+", "[x,", "\\sqrt{", "\\frac{1}{"]),
    body=st.sampled_from(["1", "x", "\\frac{1}{2}", "}", ""]),
)
def test_fuzz_nested_groups(depth, opener, body):
    closer = {"(": ")", "[": "]"}.get(opener[0], "}")
    _timed("\\boxed{" + opener * depth + body + closer * depth + "}", "1")


@settings(max_examples=50, deadline=None, derandomize=True)
@given(a=st.integers(-(10**6), 10**6), b=st.integers(1, 10**6))
def test_fuzz_fractions_agree_with_decimals(a, b):
    """a/b equals its exact decimal when one exists, and never equals a different number."""
    assert compute_score(f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a}/{b}") == 1.0
    assert compute_score(f"\\boxed{{{a + 1}/{b}}}", f"{a}/{b}") == 0.0
