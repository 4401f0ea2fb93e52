"""Canonical forms of answer strings, before any symbolic work.

Two things come out of an answer: a canonical LaTeX text (spacing, ``\\dfrac``, degree marks,
units, ``\\sqrt 2``, mixed numbers and trailing punctuation settled), which is compared as text
and handed to the LaTeX parser; and, when the answer is a plain number, its exact value as a
``Fraction``, which lets most comparisons skip sympy entirely.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 512
"""Longer answers are not parsed at all (they cannot be a short final answer anyway)."""

MAX_NUMBER_DIGITS = 100

_TEXT_OPEN = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox)\s*\{"
)
_REMOVE = re.compile(
    r"\\displaystyle|\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,;:!>]|\\quad|\\qquad|~"
)
_UNIT_POWER = re.compile(r"\s*\^\s*(?:[23]|\{\s*[23]\s*\})")
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\^\s*\{\s*\\circ\s*\}|°|\\degree|\\circ")
_FRAC = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_SQRT_SHORT = re.compile(r"\\sqrt\s*([0-9a-zA-Z])")
_FRAC_SHORT = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])")
_LEADING = re.compile(r"^(?:\\approx|=|\\sim|\\simeq)\s*")
_TRAILING = re.compile(r"[\s.,;:]+$")
_MIXED = re.compile(r"^(-?)\s*(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}$")
_TOKENS = re.compile(r"\\[a-zA-Z]+|\\.|\d+(?:\.\d+)?|[a-zA-Z]+|\S")
_PLAIN = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)$")
_PLAIN_RATIO = re.compile(r"^([+-]?)(\d+)/(\d+)$")
_PLAIN_FRAC = re.compile(r"^([+-]?)\\frac\{(\d+)\}\{(\d+)\}$")
_BRACED_COMMA = re.compile(r"\{\s*,\s*\}|,\s*\\!\s*")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
"""``1,234,567``: digit groups of three after a comma with no space, the whole answer; as in
math-verify's parser. ``1, 234`` (a space) or ``(1,234)`` stay tuples."""
_WORD = re.compile(r"(?<![\\a-zA-Z])(?!(?:sqrt|sin|cos|tan|log|exp|pi)\b)[a-zA-Z]{3,}")


def _closing_brace(s: str, open_at: int) -> int:
    """Index of the brace closing the group opened at ``open_at``, or -1."""
    depth = 0
    for j in range(open_at, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def _unwrap_text(s: str) -> str:
    """Drop ``\\text{...}`` groups (units) after a value; keep their words when they ARE the value.

    ``5\\text{ cm}`` gives ``5``; ``\\text{Yes}`` gives ``Yes``.
    """
    kept: list[str] = []
    words: list[str] = []
    i = 0
    while (m := _TEXT_OPEN.search(s, i)) is not None:
        close = _closing_brace(s, m.end() - 1)
        if close == -1:
            break
        word = s[m.end() : close].strip()
        # "\\text{ and }" separates answers ("\\angle 1 and \\angle 5"); other text is a unit.
        kept.append(s[i : m.start()] + (f" {word} " if word in ("and", "or") else " "))
        words.append(word)
        i = close + 1
        unit_power = _UNIT_POWER.match(s, i)  # cm^2, units^{3}
        if unit_power:
            i = unit_power.end()
    kept.append(s[i:])
    rest = "".join(kept).strip()
    return rest if rest else " ".join(words)


_CLOSE_OF = {"{": "}", "(": ")", "[": "]"}


def _drop_redundant_groups(tokens: list[str]) -> list[str]:
    """``((8))`` -> ``(8)``, ``\\frac{{1}}{2}`` -> ``\\frac{1}{2}``: a group whose whole content
    is one group of the same kind says nothing more, and the LaTeX grammar's cost grows steeply
    with such nesting."""
    match: dict[int, int] = {}
    stack: list[int] = []
    for i, tok in enumerate(tokens):
        if tok in _CLOSE_OF:
            stack.append(i)
        elif stack and tok == _CLOSE_OF[tokens[stack[-1]]]:
            match[stack.pop()] = i
    drop: set[int] = set()
    for i, j in match.items():
        if match.get(i + 1) == j - 1 and tokens[i + 1] == tokens[i]:
            drop.update((i + 1, j - 1))
    return [tok for i, tok in enumerate(tokens) if i not in drop]


def canonical(answer: str) -> str:
    """Canonical LaTeX text of an answer ("" when there is nothing to compare).

    Deterministic and linear in the input; every comparison goes through it.
    """
    if not isinstance(answer, str):
        return ""
    s = answer.strip()
    if not s or len(s) > MAX_ANSWER_CHARS:
        return ""
    # ``14{,}916`` and ``11,\\! 111``: LaTeX's thousands separators, a comma without its space.
    s = _BRACED_COMMA.sub(",", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("≈", "\\approx ")
    s = _REMOVE.sub(" ", s)
    s = _DEGREE.sub("", s)
    s = _FRAC.sub(r"\\frac", s)
    s = _unwrap_text(s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _LEADING.sub("", _TRAILING.sub("", s).strip())
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    mixed = _MIXED.match(s)
    if mixed:
        sign, whole, num, den = mixed.groups()
        if 0 < int(num) < int(den):
            s = f"{sign}\\frac{{{int(whole) * int(den) + int(num)}}}{{{den}}}"
    return " ".join(_drop_redundant_groups(_TOKENS.findall(s)))


def plain_number(canon: str) -> Fraction | None:
    """Exact value of an integer, decimal, ``a/b`` or ``\\frac{a}{b}``; None for anything else."""
    s = canon.replace(" ", "")
    if not s or len(s) > 2 * MAX_NUMBER_DIGITS + 16:
        return None
    m = _PLAIN.match(s)
    if m:
        value = Fraction(m.group(2))
    else:
        m = _PLAIN_RATIO.match(s) or _PLAIN_FRAC.match(s)
        if not m or int(m.group(3)) == 0:
            return None
        value = Fraction(int(m.group(2)), int(m.group(3)))
    return -value if m.group(1) == "-" else value


def is_text_answer(canon: str) -> bool:
    """True for answers made of words (``not enough information``), compared only as text."""
    return _WORD.search(canon) is not None
