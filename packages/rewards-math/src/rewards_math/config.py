"""`RewardConfig`: which reward scores the responses, and how many processes score a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from rewards_math.batch import BatchScorer
from rewards_math.rewards import REWARDS, build


@dataclass
class RewardConfig:
    """The settings of a run's reward (`build()`: its `BatchScorer`)."""

    reward_type: str = field(
        default="math", metadata={"help": "reward", "choices": lambda: list(REWARDS)}
    )
    reward_tolerance: float = field(
        default=0.0,
        metadata={
            "help": "geo3k / math_format: relative numeric tolerance (the recipes tried 0.05)",
            "ge": 0,
        },
    )
    reward_workers: int | None = field(
        default=None, metadata={"help": "processes that score responses (default: cores)", "ge": 1}
    )

    def options(self) -> dict[str, float]:
        """The reward's keyword options."""
        return {"tolerance": self.reward_tolerance} if self.reward_tolerance else {}

    def check(self) -> None:
        """The reward is built once here, so that a bad option stops a launcher before any
        work (a `ValueError` naming the flags)."""
        try:
            build(self.reward_type, **self.options())
        except ValueError as err:
            raise ValueError(f"--reward-type / --reward-tolerance: {err}") from None

    def build(self) -> BatchScorer:
        """The scorer (worker processes for large batches; `close()` it)."""
        return BatchScorer(self.reward_type, num_workers=self.reward_workers, **self.options())
