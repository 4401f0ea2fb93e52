"""Is a predicted answer mathematically equal to the ground truth?

Order of checks, cheapest first:

1. canonical text equal (``5 \\sqrt { 13 }`` vs ``5\\sqrt{13}``, ``\\angle 3 \\cong \\angle Z``);
2. both plain numbers: exact ``Fraction`` comparison (``15`` vs ``15.0``, ``0.5`` vs ``1/2``), no sympy;
3. otherwise both sides are parsed by math-verify's LaTeX parser (latex2sympy2-extended, an ANTLR
   grammar: nothing is ever ``eval``-ed) and compared with ``math_verify.verify``.

Decimals are turned into exact rationals before step 3, so under strict equality a rounded decimal
never equals an irrational value (``7.07`` is not ``5\\sqrt{2}``). A relative ``tolerance`` (the
geo3k reward) accepts rounded labels and rounded predictions of numeric answers.

math-verify bounds its own time with ``signal.alarm``, which raises outside the main thread (Ray
actors, thread pools). Its timeouts are therefore off here, and time is bounded instead by
length caps, guards that refuse expressions whose evaluation could explode (power towers, huge
exponents or factorials, sums, integrals, limits) before sympy sees them, and, for batches, the
per-item timeout of the process pool (see ``batch.py``).
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache

from rewards_math.normalize import canonical, is_text_answer, plain_number

logger = logging.getLogger(__name__)

MAX_PARSE_CHARS = 256
"""Canonical answers longer than this are compared as text only."""
MAX_NESTING = 8
"""Bracket depth cap: the LaTeX grammar's cost roughly doubles with each level of plain grouping."""
MAX_EXPONENT_PRODUCT = 10_000
MAX_SYMBOLIC_EXPONENT = 16
"""Exponent caps: numbers may be raised to large powers, but a power of a symbolic or radical
expression is expanded by ``simplify``, whose cost grows steeply with the exponent."""
MAX_FACTORIAL = 200

_HEAVY = re.compile(r"\\(?:sum|prod|int|iint|iiint|oint|lim|limsup|liminf|binom|choose)\b")
_GROWTH = re.compile(r"\\(?:exp|sinh|cosh|Gamma|gamma|operatorname)(?![a-zA-Z])")
_INT = re.compile(r"\d+")
_FACTORIAL = re.compile(r"(\d*)\s*!")


class _DisabledTimeoutWarning(logging.Filter):
    """Drop math-verify's one-off "timeout is disabled" warning: time is bounded here instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DisabledTimeoutWarning())


_PAIRS = {"{": "}", "(": ")", "[": "]"}
_OPEN_OF = {v: k for k, v in _PAIRS.items()}


def _group_end(s: str, i: int) -> int:
    """End (exclusive) of the argument that starts at ``s[i]``: a bracketed group or one token."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return i
    if s[i] in _PAIRS:
        depth = 0
        for j in range(i, len(s)):
            if s[j] in _PAIRS:
                depth += 1
            elif s[j] in _OPEN_OF:
                depth -= 1
                if depth == 0:
                    return j + 1
        return len(s)
    if s[i] == "\\":
        j = i + 1
        while j < len(s) and s[j].isalpha():
            j += 1
        return max(j, i + 2)
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    return max(j, i + 1)


def _group_start(s: str, end: int) -> int:
    """Start of the bracketed group that closes just before ``end`` (the base of a power)."""
    j = end - 1
    while j >= 0 and s[j] == " ":
        j -= 1
    if j < 0 or s[j] not in _OPEN_OF:
        return max(j, 0)
    depth = 0
    for k in range(j, -1, -1):
        if s[k] in _OPEN_OF:
            depth += 1
        elif s[k] in _PAIRS:
            depth -= 1
            if depth == 0:
                return k
    return 0


def is_safe_to_parse(canon: str) -> bool:
    """Refuse inputs whose symbolic evaluation could take unbounded time or memory.

    sympy evaluates integer powers eagerly, so ``10^{10^{10}}`` would try to build a number
    with ten billion digits; a power tower, an exponent whose integers multiply past
    ``MAX_EXPONENT_PRODUCT``, a large factorial, or a sum/integral/limit is refused.
    """
    if len(canon) > MAX_PARSE_CHARS or _HEAVY.search(canon):
        return False
    depth = peak = 0
    for ch in canon:
        if ch in "{([":
            depth += 1
            peak = max(peak, depth)
        elif ch in "})]":
            depth -= 1
    if peak > MAX_NESTING:
        return False
    if any(len(d) > 100 for d in _INT.findall(canon)):
        return False
    for m in _FACTORIAL.finditer(canon):
        if not m.group(1) or int(m.group(1)) > MAX_FACTORIAL:
            return False
    # exp(exp(exp(100))) has a value no evaluation can reach: allow one fast-growing function
    # and treat its argument like an exponent.
    growth = list(_GROWTH.finditer(canon))
    if len(growth) > 1:
        return False
    symbolic = any(ch.isalpha() for ch in canon)
    cap = MAX_SYMBOLIC_EXPONENT if symbolic else MAX_EXPONENT_PRODUCT
    starts = [m.end() - 1 for m in growth] + [i for i, ch in enumerate(canon) if ch == "^"]
    for start in starts:
        exponent = canon[start + 1 : _group_end(canon, start + 1)]
        if "^" in exponent or (
            canon[start] == "^" and "^" in canon[_group_start(canon, start) : start]
        ):
            return False  # a power tower: 10^{10^{10}}, (10^{99})^{99}
        product = 1
        for digits in _INT.findall(exponent):
            product *= max(int(digits), 1)
            if product > cap:
                return False
        # a power applied to a power, as in 2^{3}^{4}, is a tower too
        after = _group_end(canon, start + 1)
        if canon[after:].lstrip().startswith("^"):
            return False
    return True


@lru_cache(maxsize=4096)
def parse_answer(canon: str):
    """Parse a canonical answer into a sympy object with exact rationals, or None.

    Uses only math-verify's LaTeX extraction (never its plain-expression extraction, which
    calls sympy's ``parse_expr``), with its signal-based timeout turned off.
    """
    if not canon or not is_safe_to_parse(canon) or is_text_answer(canon):
        return None
    import sympy
    from math_verify import LatexExtractionConfig, parse

    try:
        found = parse(
            f"${canon}$",
            extraction_config=[LatexExtractionConfig(boxed_match_priority=-1)],
            fallback_mode="no_fallback",
            parsing_timeout=None,
        )
    except Exception:  # math-verify catches its own errors; this is belt and braces
        logger.debug("could not parse %r", canon, exc_info=True)
        return None
    if not found or not isinstance(found[0], sympy.Basic | sympy.MatrixBase):
        return None
    expr = found[0]
    try:
        floats = expr.atoms(sympy.Float)
        if floats:
            expr = expr.xreplace({f: sympy.Rational(str(f)) for f in floats})
    except Exception:
        return None
    return expr


def _as_float(expr) -> float | None:
    """Numeric value of a closed-form real number, or None (symbols, sets, complex...)."""
    import sympy

    try:
        if not isinstance(expr, sympy.Expr) or expr.free_symbols or not expr.is_number:
            return None
        value = complex(expr.evalf(30))
    except Exception:
        return None
    if value.imag != 0 or not math.isfinite(value.real):
        return None
    return value.real


_PROBES = ((0.5772156649, 1.4142135623), (2.7182818284, -0.3183098861))
"""Points at which two expressions are compared before any simplification (irrational, so that
distinct polynomials with small integer coefficients do not agree there by accident)."""


def _clearly_different(gold, pred) -> bool:
    """A quick, sound "no": the expressions take different values at a probe point.

    ``simplify(gold - pred)`` is where symbolic comparison spends its time, and most wrong
    answers differ numerically, so they never reach it. Undefined values prove nothing.
    """
    import sympy

    if not (isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr)):
        return False
    symbols = sorted(gold.free_symbols | pred.free_symbols, key=str)
    if len(symbols) > 6:
        return False
    for probe in _PROBES:
        subs = {s: probe[i % 2] + i for i, s in enumerate(symbols)}
        try:
            g = complex(gold.evalf(20, subs=subs))
            p = complex(pred.evalf(20, subs=subs))
        except Exception:
            continue
        if not all(math.isfinite(v) for v in (g.real, g.imag, p.real, p.imag)):
            continue
        if abs(g - p) > 1e-9 * max(1.0, abs(g), abs(p)):
            return True
    return False


def _within(pred: float, gold: float, tolerance: float) -> bool:
    return abs(pred - gold) <= tolerance * max(1.0, abs(gold))


@lru_cache(maxsize=16384)
def _equivalent(pred: str, gold: str, tolerance: float) -> bool:
    if pred == gold:
        return True
    pred_num, gold_num = plain_number(pred), plain_number(gold)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num or (
            tolerance > 0 and _within(float(pred_num), float(gold_num), tolerance)
        )
    pred_expr, gold_expr = parse_answer(pred), parse_answer(gold)
    if pred_expr is None or gold_expr is None:
        return False
    if tolerance > 0:
        p, g = _as_float(pred_expr), _as_float(gold_expr)
        if p is not None and g is not None and _within(p, g, tolerance):
            return True
    if _clearly_different(gold_expr, pred_expr):
        return False
    from math_verify import verify

    return bool(verify(gold_expr, pred_expr, timeout_seconds=None))


def is_equivalent(pred: str, gold: str, *, tolerance: float = 0.0) -> bool:
    """True when answer ``pred`` equals ``gold`` (strictly, or within a relative ``tolerance``).

    Both are answer strings (the content of a boxed answer, not a whole response). Never raises:
    anything that cannot be compared is "not equal".
    """
    try:
        p, g = canonical(pred), canonical(gold)
        if not p or not g:
            return False
        return _equivalent(p, g, float(tolerance))
    except Exception:  # a reward must never take the run down
        logger.warning("comparison failed for pred=%.80r gold=%.80r", pred, gold, exc_info=True)
        return False
