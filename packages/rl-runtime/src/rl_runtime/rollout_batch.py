"""From prompts and their completions to a `TrainBatch` aligned to `input_ids`.

Everything per token follows the token alignment convention of docs/architecture.md: the
sequence is prompt + response ids exactly as generated, the loss mask covers the response, and
the rollout log-probs sit at the response positions (0 on the prompt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_algos import TrainBatch

log = logging.getLogger(__name__)


def usable(completion: Any) -> bool:
    """A completion the trainer can learn from (not an engine error)."""
    if getattr(completion, "error", None):
        return False
    return getattr(completion, "finish_reason", None) != "error"


@dataclass
class _GroupScore:
    completions: list[Any]  # the group's list as the engines returned it (identity checked)
    kept: list[Any]  # usable, well-formed completions
    rewards: list[float]
    bad: int  # engine errors
    malformed: int  # usable, but holding a forbidden token


class ScoredGroups:
    """Rewards of each prompt's group, computed as soon as its engine's results arrive.

    ``RolloutGroup.generate(..., on_ready=scored)`` hands over the groups of each engine that
    finishes while others still generate, so their scoring overlaps the rest of the rollout;
    :meth:`finish` scores what is left (all of it with one engine) and flattens the result in
    prompt order. A group is scored again if the rollout was repeated (a restarted engine):
    the groups :meth:`finish` receives are the ones that count.
    """

    def __init__(
        self,
        prompts: Sequence[Any],
        decode: Callable[[Sequence[int]], str],
        score: Callable[[Sequence[str], Sequence[str]], list[float]],
        forbidden_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.prompts, self.decode, self.score = prompts, decode, score
        self.forbidden = forbidden_token_ids
        self._groups: dict[int, _GroupScore] = {}

    def __call__(self, indices: Sequence[int], groups: Sequence[list[Any]]) -> None:
        self._score(list(indices), list(groups))

    def _score(self, indices: list[int], groups: list[list[Any]]) -> None:
        kept_by_group, texts, answers = [], [], []
        for g, completions in zip(indices, groups, strict=True):
            ok = [c for c in completions if usable(c)]
            kept = [c for c in ok if not self.forbidden.intersection(c.token_ids)]
            kept_by_group.append(
                (completions, kept, len(completions) - len(ok), len(ok) - len(kept))
            )
            texts += [self.decode(c.token_ids) for c in kept]
            answers += [str(self.prompts[g].answer)] * len(kept)
        rewards = iter(self.score(texts, answers) if texts else [])
        for g, (completions, kept, bad, malformed) in zip(indices, kept_by_group, strict=True):
            group_rewards = [next(rewards) for _ in kept]
            self._groups[g] = _GroupScore(completions, kept, group_rewards, bad, malformed)

    def finish(
        self, groups: Sequence[list[Any]]
    ) -> tuple[list[tuple[int, Any, Any]], list[float], int, int]:
        """Score the groups not scored yet; returns ``(flat, rewards, bad, malformed)``:
        ``(group index, prompt, completion)`` of every kept completion in prompt order, their
        rewards, and the counts of engine errors and of malformed completions."""
        todo = [
            g
            for g, completions in enumerate(groups)
            if g not in self._groups or self._groups[g].completions is not completions
        ]
        if todo:
            self._score(todo, [groups[g] for g in todo])
        flat, rewards, bad, malformed = [], [], 0, 0
        for g in range(len(groups)):
            entry = self._groups[g]
            flat += [(g, self.prompts[g], c) for c in entry.kept]
            rewards += entry.rewards
            bad += entry.bad
            malformed += entry.malformed
        return flat, rewards, bad, malformed


def build_train_batch(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    advantages: torch.Tensor,
) -> TrainBatch:
    """One sample per (prompt, completion) pair; `advantages[i]` goes on sample i's response.
    The engines' ``routed_experts`` (``[prompt + response - 1, layers, k]``) become the batch's
    per-token ``routed_experts`` when every completion has them."""
    input_ids, loss_mask, adv, pixels, grids, mm = [], [], [], [], [], []
    rollout_lp: list[torch.Tensor] | None = []
    # routing replay: the engine's experts for every token; only when every sample has them
    routed: list[torch.Tensor] | None = []
    has_mm = all(getattr(p, "mm_token_type_ids", None) is not None for p in prompts)
    for prompt, comp, a in zip(prompts, completions, advantages.tolist(), strict=True):
        prompt_ids = torch.as_tensor(prompt.input_ids, dtype=torch.long).reshape(-1)
        resp = torch.as_tensor(list(comp.token_ids), dtype=torch.long)
        lp, lr = prompt_ids.numel(), resp.numel()
        input_ids.append(torch.cat([prompt_ids, resp]))
        mask = torch.cat([torch.zeros(lp), torch.ones(lr)])
        loss_mask.append(mask)
        adv.append(mask * float(a))
        logprobs = torch.as_tensor(list(comp.logprobs or ()), dtype=torch.float32)
        if logprobs.numel() != lr:  # an engine that reports no log-probs: none for the batch
            rollout_lp = None
        if rollout_lp is not None:
            rollout_lp.append(torch.cat([torch.zeros(lp), logprobs]))
        experts = getattr(comp, "routed_experts", None)
        if experts is None or experts.shape[0] != lp + lr - 1:
            routed = None
        if routed is not None:
            # the last token was never run by the engine: its row is any valid one (it
            # predicts nothing the loss reads), here the row before it
            routed.append(torch.cat([experts, experts[-1:]]))
        pixels.append(getattr(prompt, "pixel_values", None))
        grids.append(getattr(prompt, "image_grid_thw", None))
        if has_mm:
            mm.append(
                torch.cat(
                    [torch.as_tensor(prompt.mm_token_type_ids).reshape(-1).long(), torch.zeros(lr)]
                ).long()
            )
    return TrainBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        advantages=adv,
        rollout_logprobs=rollout_lp,
        pixel_values=pixels,
        image_grid_thw=grids,
        mm_token_type_ids=mm if has_mm else None,
        routed_experts=routed or None,
    )
