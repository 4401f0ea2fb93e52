"""extract_boxed: last boxed answer, nested braces, \\fbox, brace-less form, unclosed boxes."""

import pytest

from rewards_math import extract_boxed, has_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b^{2}}}}", "\\sqrt{\\frac{a}{b^{2}}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} and finally \\fbox{9}", "9"),
        ("\\fbox{3} and finally \\boxed{9}", "9"),
        ("$\\boxed 5$", "5"),
        ("\\boxed {12}", "12"),
        ("\\boxed{}", ""),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\angle 3 \\cong \\angle Z}", "\\angle 3 \\cong \\angle Z"),
    ],
)
def test_extracts_last_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no box here",
        "",
        "\\boxed{unclosed",
        "\\boxed{1} and \\boxed{truncated",  # the final answer was cut off
        "\\boxeddots",
        "\\boxed",
    ],
)
def test_none_when_no_closed_final_box(text):
    assert extract_boxed(text) is None
    assert not has_boxed(text)


def test_non_string_input_gives_none():
    assert extract_boxed(None) is None  # type: ignore[arg-type]
    assert extract_boxed(12) is None  # type: ignore[arg-type]


def test_deeply_nested_and_long():
    depth = 5000
    assert extract_boxed("\\boxed{" + "{" * depth + "x" + "}" * depth + "}") == (
        "{" * depth + "x" + "}" * depth
    )
    text = "word " * 20_000 + "\\boxed{17}"
    assert extract_boxed(text) == "17"
