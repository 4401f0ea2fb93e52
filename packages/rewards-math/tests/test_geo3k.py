"""Over the real Geometry3K validation split: each row's own answer, boxed verbatim, scores 1 and
every other choice scores 0 (choices numerically equal to the answer are skipped)."""

from fractions import Fraction

import pyarrow.parquet as pq
import pytest

from rewards_math import compute_score


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


@pytest.fixture(scope="module")
def validation_rows(geo3k_dir):
    table = pq.read_table(geo3k_dir / "validation.parquet", columns=["id", "answer", "choices"])
    return table.to_pylist()


@pytest.mark.parametrize("reward_type", ["math", "geo3k"])
def test_own_answer_scores_one_and_other_choices_zero(validation_rows, reward_type):
    assert len(validation_rows) == 300
    wrong: list[str] = []
    compared = 0
    for row in validation_rows:
        answer = row["answer"]
        response = f"Working through the figure... so the answer is \\boxed{{{answer}}}."
        if compute_score(response, answer, reward_type=reward_type) != 1.0:
            wrong.append(f"row {row['id']}: own answer {answer!r} scored 0")
        for choice in row["choices"]:
            if choice.strip() == answer.strip():
                continue
            value = _number(choice)
            if value is not None and value == _number(answer):
                continue
            compared += 1
            if compute_score(f"\\boxed{{{choice}}}", answer, reward_type=reward_type) != 0.0:
                wrong.append(f"row {row['id']}: choice {choice!r} matched answer {answer!r}")
    assert not wrong, "\n".join(wrong)
    assert compared > 800  # three distractors a row


def test_geo3k_tolerance_accepts_rounded_forms(validation_rows):
    """A rounded decimal of a radical answer passes geo3k at 5% but not the strict math reward."""
    radical = next(r for r in validation_rows if r["answer"] == "5 \\sqrt { 13 }")
    response = "\\boxed{18.03}"
    assert compute_score(response, radical["answer"]) == 0.0
    assert compute_score(response, radical["answer"], reward_type="geo3k", tolerance=0.05) == 1.0
