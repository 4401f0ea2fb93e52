"""Math reward throughput: responses scored per second on one core, ours vs plain math-verify.

Responses are ~400 tokens (about 1,600 characters of reasoning with inline LaTeX) ending in a
boxed answer, built from the real Geometry3K validation answers: a third correct as written, a
third correct in another form (``\\dfrac``, no spaces, ``15.0``), a third wrong (another choice).
The baseline is what a first version would do: ``math_verify.parse`` on the whole response and
``math_verify.verify`` against the parsed answer, default settings. Both run in the same process.

    uv run python tools/bench/bench_rewards.py --out /tmp/bench_rewards.json

"Cold" clears our caches before every item (each response is new); "warm" keeps them, as in
GRPO where the answers of one prompt's samples repeat. Agreement between the two scorers is
reported, since a fast scorer that disagrees is no use.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from harness import Timing, shared_dir, workspace_paths, write_json

sys.path.extend(workspace_paths())  # a checkout without the workspace installed

FILLER = [
    "Let the unknown side be $x$. ",
    "By the Pythagorean theorem, $a^2 + b^2 = c^2$, so $x^2 = 12^2 + 5^2$. ",
    "The angles of a triangle add up to $180^\\circ$, hence $m\\angle B = 180 - 62 - 38$. ",
    "Since the chords are congruent, the arcs they cut are congruent as well. ",
    "The area of the sector is $\\frac{\\theta}{360} \\pi r^2$ with $r = 6$. ",
    "Using the law of sines, $\\frac{\\sin A}{a} = \\frac{\\sin B}{b}$. ",
    "Substituting the given lengths, we get $3x + 7 = 5x - 9$, so $2x = 16$. ",
    "The perimeter is the sum of all four sides of the trapezoid. ",
    "Dropping an altitude splits the base into segments of 4 and 9. ",
    "Check: the value is positive and the triangle inequality holds. ",
]


def _other_form(answer: str) -> str:
    """The same value written differently, as a model might."""
    compact = answer.replace(" ", "")
    if "\\frac" in compact:
        return compact.replace("\\frac", "\\dfrac")
    if compact.lstrip("-").isdigit():
        return compact + ".0"
    return compact


def build_responses(rows: list[dict], n: int, seed: int) -> list[tuple[str, str, str]]:
    """(response, answer, kind) triples; kind is correct / other-form / wrong."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        answer = row["answer"]
        kind = ("correct", "other-form", "wrong")[i % 3]
        if kind == "correct":
            boxed = answer
        elif kind == "other-form":
            boxed = _other_form(answer)
        else:
            wrong = [c for c in row["choices"] if c.replace(" ", "") != answer.replace(" ", "")]
            boxed = rng.choice(wrong) if wrong else answer + "+1"
        text = []
        while sum(map(len, text)) < 1600:
            text.append(rng.choice(FILLER))
        text.append(f"Therefore the answer is $\\boxed{{{boxed}}}$.")
        out.append(("".join(text), answer, kind))
    return out


def load_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["answer", "choices"]).to_pylist()


def run_baseline(items):
    from math_verify import parse, verify

    scores, times = [], []
    for response, answer, _ in items:
        t = time.perf_counter()
        gold = parse(f"${answer}$")
        pred = parse(response)
        scores.append(1.0 if verify(gold, pred) else 0.0)
        times.append(time.perf_counter() - t)
    return scores, times


def run_ours(items, cold: bool):
    import math_verify.parser as mv_parser

    from rewards_math import compute_score
    from rewards_math.equivalence import _equivalent, parse_answer

    scores, times = [], []
    for response, answer, _ in items:
        if cold:
            _equivalent.cache_clear()
            parse_answer.cache_clear()
            mv_parser.parse_latex_cached.cache_clear()
        t = time.perf_counter()
        scores.append(compute_score(response, answer))
        times.append(time.perf_counter() - t)
    return scores, times


def summary(times: list[float]) -> dict:
    t = Timing.of(times)
    return {
        "responses_per_s": len(t.times) / t.total,
        "mean_ms": 1e3 * t.mean,
        "p50_ms": 1e3 * t.percentile(0.5),
        "p99_ms": 1e3 * t.percentile(0.99),
        "max_ms": 1e3 * t.max,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=shared_dir() / "data" / "geo3k" / "validation.parquet",
        help="Geometry3K parquet with answer and choices columns",
    )
    parser.add_argument("--n", type=int, default=600, help="number of responses")
    parser.add_argument("--seed", type=int, default=0, help="seed for fillers and wrong choices")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args()

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    items = build_responses(load_rows(args.data), args.n, args.seed)
    chars = statistics.fmean(len(r) for r, _, _ in items)

    # Import and warm both libraries outside the timed loops.
    from math_verify import parse, verify

    from rewards_math import compute_score

    compute_score("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")
    verify(parse("$\\sqrt{8}$"), parse("\\boxed{2\\sqrt{2}}"))

    base_scores, base_times = run_baseline(items)
    cold_scores, cold_times = run_ours(items, cold=True)
    warm_scores, warm_times = run_ours(items, cold=False)
    assert cold_scores == warm_scores, "caching changed a score"

    from rewards_math import canonical
    from rewards_math.normalize import plain_number

    plain = [plain_number(canonical(a)) is not None for _, a, _ in items]
    by_answer = {
        name: {
            "n": sum(1 for p in plain if p == want),
            "ours_cold_mean_ms": 1e3
            * statistics.fmean(t for t, p in zip(cold_times, plain, strict=True) if p == want),
            "baseline_mean_ms": 1e3
            * statistics.fmean(t for t, p in zip(base_times, plain, strict=True) if p == want),
        }
        for name, want in (("plain_number_answers", True), ("latex_answers", False))
    }
    expected = [0.0 if kind == "wrong" else 1.0 for _, _, kind in items]
    result = {
        "benchmark": "rewards_math.compute_score vs math_verify.parse+verify on whole responses",
        "n_responses": len(items),
        "mean_response_chars": round(chars),
        "approx_tokens": round(chars / 4),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "baseline": summary(base_times),
        "ours_cold": summary(cold_times),
        "ours_warm": summary(warm_times),
        "by_answer": by_answer,
        "speedup_cold": sum(base_times) / sum(cold_times),
        "speedup_warm": sum(base_times) / sum(warm_times),
        "accuracy_vs_labels": {
            "baseline": sum(s == e for s, e in zip(base_scores, expected, strict=True))
            / len(items),
            "ours": sum(s == e for s, e in zip(cold_scores, expected, strict=True)) / len(items),
        },
        "agreement": sum(a == b for a, b in zip(base_scores, cold_scores, strict=True))
        / len(items),
    }
    for name in ("baseline", "ours_cold", "ours_warm"):
        s = result[name]
        print(
            f"{name:10s} {s['responses_per_s']:9.1f} responses/s  mean {s['mean_ms']:7.2f} ms  "
            f"p99 {s['p99_ms']:7.2f} ms  max {s['max_ms']:7.2f} ms"
        )
    print(
        f"speedup: {result['speedup_cold']:.1f}x cold, {result['speedup_warm']:.1f}x warm; "
        f"accuracy vs labels: baseline {result['accuracy_vs_labels']['baseline']:.3f}, "
        f"ours {result['accuracy_vs_labels']['ours']:.3f}; agreement {result['agreement']:.3f}"
    )
    for name, row in by_answer.items():
        print(
            f"{name:22s} n={row['n']:4d}  ours cold {row['ours_cold_mean_ms']:6.2f} ms  "
            f"baseline {row['baseline_mean_ms']:6.2f} ms"
        )
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
