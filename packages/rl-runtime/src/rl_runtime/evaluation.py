"""Evaluation: pass@1 on a held-out split, with the rollout engines and the training reward."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from rl_runtime.protocols import Decoder, PromptSource
from rl_runtime.rollout_batch import usable

log = logging.getLogger(__name__)

Scorer = Callable[[Sequence[str], Sequence[str]], list[float]]


def eval_prompts(source: PromptSource, max_prompts: int | None = None) -> list[Any]:
    """The valid prompts of `source` in row order (bad rows skipped and counted by the source)."""
    out = []
    for i in range(len(source)):
        if max_prompts is not None and len(out) >= max_prompts:
            break
        sample = source.get(i)
        if sample is not None:
            out.append(sample)
    return out


def evaluate(
    rollout: Any,
    prompts: Sequence[Any],
    *,
    decode: Decoder,
    score: Scorer,
    n: int = 1,
    batch_size: int = 64,
    **sampling: Any,
) -> dict[str, float]:
    """pass@1 = mean 0/1 reward over `n` samples of every prompt (a failed request scores 0)."""
    rewards: list[float] = []
    lengths: list[int] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        groups = rollout.generate(chunk, n=n, **sampling)
        texts, answers = [], []
        for prompt, comps in zip(chunk, groups, strict=True):
            for c in comps:
                texts.append(decode(c.token_ids) if usable(c) else "")
                answers.append(str(prompt.answer))
                lengths.append(len(c.token_ids))
        rewards.extend(score(texts, answers))
    if not rewards:
        return {}
    return {
        "eval_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "eval_reward_mean": sum(rewards) / len(rewards),
        "eval_response_length_mean": sum(lengths) / len(lengths),
        "eval_num_prompts": len(prompts),
    }
