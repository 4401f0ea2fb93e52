"""Each equality rule of the math reward, on answer strings."""

import pytest

from rewards_math import canonical, is_equivalent
from rewards_math.equivalence import is_safe_to_parse
from rewards_math.normalize import plain_number

EQUAL = [
    # LaTeX spacing (geo3k writes answers with spaces inside commands)
    ("5\\sqrt{13}", "5 \\sqrt { 13 }"),
    ("5 \\sqrt{13}", "5\\sqrt { 13 }"),
    # fractions in all spellings
    ("\\frac{40}{3}", "\\frac { 40 } { 3 }"),
    ("\\dfrac{40}{3}", "\\frac { 40 } { 3 }"),
    ("\\tfrac{40}{3}", "\\frac { 40 } { 3 }"),
    ("40/3", "\\frac { 40 } { 3 }"),
    ("\\frac{80}{6}", "\\frac { 40 } { 3 }"),
    ("\\frac12", "0.5"),
    # braces-less square roots
    ("\\sqrt 2", "\\sqrt{2}"),
    ("\\frac { 21 \\sqrt 2 } { 2 }", "\\frac{21\\sqrt{2}}{2}"),
    # pi
    ("10\\pi", "10 \\pi"),
    ("\\frac{\\pi}{2}", "0.5\\pi"),
    # degree marks and units
    ("30^\\circ", "30"),
    ("30^{\\circ}", "30"),
    ("30°", "30"),
    ("5 \\text{ cm}", "5"),
    ("5\\,\\mathrm{cm}", "5"),
    ("12 \\text{ units}^2", "12"),
    # a leading approximation sign
    ("\\approx 13.5", "13.5"),
    ("≈ 13.5", "13.5"),
    # trailing punctuation, dollars, \left/\right
    ("15.", "15"),
    ("15,", "15"),
    ("$15$", "15"),
    ("\\left(3\\right)", "3"),
    # integers written as decimals
    ("15.0", "15"),
    ("15.00", "15"),
    ("0.50", "\\frac{1}{2}"),
    ("-1", "- 1"),
    # mixed numbers
    ("4 \\frac { 4 } { 11 }", "\\frac{48}{11}"),
    ("4\\frac{4}{11}", "48/11"),
    # equivalent radicals and sums
    ("4\\sqrt{2}", "\\sqrt{32}"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
    ("4\\sqrt{3} + 4\\sqrt{2} + 24", "24 + 4 \\sqrt { 2 } + 4 \\sqrt { 3 }"),
    # assignments and expressions
    ("x = 5", "5"),
    ("20y^2-10y", "20 y^2 - 10 y"),
    ("x<60", "x < 60"),
    # non-numeric answers, compared as normalized text
    ("\\angle 3 \\cong \\angle Z", "\\angle 3\\cong\\angle Z"),
    ("\\angle 2 \\text{ and } \\angle 6", "\\angle 2 and \\angle 6"),
    ("\\text{not enough information}", "not enough information"),
]

NOT_EQUAL = [
    ("16", "15"),
    ("5\\sqrt{13}", "\\sqrt { 253 }"),
    ("\\frac{40}{3}", "13.3"),
    ("7.07", "5\\sqrt{2}"),  # a rounded decimal is not an irrational number
    ("7.0710678", "5\\sqrt{2}"),
    ("31.4", "10 \\pi"),
    ("0.333333", "\\frac{1}{3}"),
    ("4\\frac{4}{11}", "\\frac{16}{11}"),
    ("\\angle 3 \\cong \\angle Z", "\\angle 1 \\cong \\angle Z"),
    ("\\angle 2 and \\angle 6", "\\angle 2 and \\angle 10"),
    ("x < 140", "x < 60"),
    ("20 y^2 + 10", "20 y^2 - 10 y"),
    ("", "5"),
    ("5", ""),
    ("not enough information", "5"),
]


@pytest.mark.parametrize(("pred", "gold"), EQUAL)
def test_equal(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize(("pred", "gold"), NOT_EQUAL)
def test_not_equal(pred, gold):
    assert not is_equivalent(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold", "tolerance", "expected"),
    [
        ("7.07", "5\\sqrt{2}", 0.05, True),
        ("7.07", "5\\sqrt{2}", 0.0, False),
        ("31.4", "10 \\pi", 0.01, True),
        ("13.3", "\\frac { 40 } { 3 }", 0.05, True),
        ("9", "5\\sqrt{2}", 0.05, False),
        ("52", "51.75", 0.05, True),  # |52 - 51.75| <= 0.05 * 51.75
        ("55", "51.75", 0.05, False),
        ("0.04", "0", 0.05, True),  # max(1, |gt|) keeps a tolerance near zero
        ("0.06", "0", 0.05, False),
    ],
)
def test_relative_tolerance(pred, gold, tolerance, expected):
    assert is_equivalent(pred, gold, tolerance=tolerance) is expected


def test_redundant_groups_are_dropped():
    assert canonical("((((8))))") == canonical("(8)")
    assert canonical("\\frac{{{1}}}{2}") == canonical("\\frac{1}{2}")
    assert canonical("(1)(2)") != canonical("(12)")
    assert is_equivalent("(" * 40 + "8" + ")" * 40, "8")


def test_canonical_forms():
    assert canonical("5 \\sqrt { 13 }") == canonical("5\\sqrt{13}")
    assert canonical("\\dfrac{1}{2}.") == canonical("\\frac{1}{2}")
    assert canonical("4 \\frac { 4 } { 11 }") == canonical("\\frac{48}{11}")
    assert canonical("\\text{Yes}") == "Yes"
    assert canonical("x" * 10_000) == ""  # too long to be a final answer


def test_plain_numbers_are_exact():
    assert plain_number(canonical("15.0")) == 15
    assert plain_number(canonical("-3/4")) == plain_number(canonical("-0.75"))
    assert plain_number(canonical("\\frac{1}{0}")) is None
    assert plain_number(canonical("5\\sqrt{2}")) is None


@pytest.mark.parametrize(
    "answer",
    [
        "10^{10^{10}}",
        "2^{3}^{4}",
        "(10^{99})^{99}",
        "x^{1000}",
        "(x+y+z)^{99}",
        "\\exp(\\exp(\\exp(100)))",
        "99999!",
        "\\sum_{i=1}^{n} i",
        "\\int_0^1 x dx",
        "1" * 200,
        "(1+" * 40 + "1" + ")" * 40,
        "{1+" * 12 + "1" + "}" * 12,
    ],
)
def test_guards_refuse_explosive_expressions(answer):
    assert not is_safe_to_parse(canonical(answer))
    assert not is_equivalent(answer, "1")


@pytest.mark.parametrize("answer", ["2^{10}", "x^{2}+x^{3}", "\\sqrt{2}^{4}", "5!", "e^{2}"])
def test_guards_allow_ordinary_powers(answer):
    assert is_safe_to_parse(canonical(answer))
