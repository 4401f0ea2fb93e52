"""ScoredGroups: groups scored as their engine answers, the rest at the end, in prompt order."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_runtime.rollout_batch import ScoredGroups

IMAGE_PAD = 99


@dataclass
class Prompt:
    answer: str


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str = "stop"
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)


class CountingScore:
    """Reward 1.0 when the decoded text equals the answer; records every call's size."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, texts, answers):
        self.calls.append(len(texts))
        return [float(t == a) for t, a in zip(texts, answers, strict=True)]


def decode(ids) -> str:
    return "".join(str(i) for i in ids)


def test_groups_handed_over_early_are_not_scored_twice_and_order_is_kept():
    prompts = [Prompt("1"), Prompt("2"), Prompt("3")]
    groups = [
        [Completion([1]), Completion([7])],
        [Completion([2]), Completion([], finish_reason="error", error="boom")],
        [Completion([3, IMAGE_PAD]), Completion([3])],
    ]
    score = CountingScore()
    scored = ScoredGroups(prompts, decode, score, frozenset({IMAGE_PAD}))
    scored([1, 2], groups[1:])  # the second engine finished first
    assert score.calls == [2]  # its 2 kept completions, at once
    flat, rewards, bad, malformed = scored.finish(groups)
    assert score.calls == [2, 2]  # only group 0 was left
    assert [(g, c.token_ids) for g, _, c in flat] == [(0, [1]), (0, [7]), (1, [2]), (2, [3])]
    assert [pr.answer for _, pr, _ in flat] == ["1", "1", "2", "3"]
    assert rewards == [1.0, 0.0, 1.0, 1.0]
    assert (bad, malformed) == (1, 1)


def test_a_repeated_rollout_is_scored_from_the_groups_that_count():
    """A restarted engine repeats the rollout: the groups finish() gets replace earlier ones."""
    prompts = [Prompt("1"), Prompt("2")]
    score = CountingScore()
    scored = ScoredGroups(prompts, decode, score)
    scored([0], [[Completion([5])]])  # from the attempt that died later
    retry = [[Completion([1])], [Completion([2])]]
    flat, rewards, bad, malformed = scored.finish(retry)
    assert [c.token_ids for _, _, c in flat] == [[1], [2]]
    assert rewards == [1.0, 1.0] and (bad, malformed) == (0, 0)


def test_nothing_usable_scores_nothing():
    scored = ScoredGroups([Prompt("1")], decode, CountingScore())
    flat, rewards, bad, _ = scored.finish([[Completion([], finish_reason="error")]])
    assert flat == [] and rewards == [] and bad == 1
