"""From prompts and their completions to a `TrainBatch` aligned to `input_ids`.

Everything per token follows the token alignment convention of docs/architecture.md: the
sequence is prompt + response ids exactly as generated, the loss mask covers the response, and
the rollout log-probs sit at the response positions (0 on the prompt).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rl_algos import TrainBatch

log = logging.getLogger(__name__)


def usable(completion: Any) -> bool:
    """A completion the trainer can learn from (not an engine error)."""
    if getattr(completion, "error", None):
        return False
    return getattr(completion, "finish_reason", None) != "error"


def build_train_batch(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    advantages: torch.Tensor,
) -> TrainBatch:
    """One sample per (prompt, completion) pair; `advantages[i]` goes on sample i's response."""
    input_ids, loss_mask, adv, rollout_lp, pixels, grids, mm = [], [], [], [], [], [], []
    has_mm = all(getattr(p, "mm_token_type_ids", None) is not None for p in prompts)
    for prompt, comp, a in zip(prompts, completions, advantages.tolist(), strict=True):
        prompt_ids = torch.as_tensor(prompt.input_ids, dtype=torch.long).reshape(-1)
        resp = torch.as_tensor(list(comp.token_ids), dtype=torch.long)
        lp, lr = prompt_ids.numel(), resp.numel()
        input_ids.append(torch.cat([prompt_ids, resp]))
        mask = torch.cat([torch.zeros(lp), torch.ones(lr)])
        loss_mask.append(mask)
        adv.append(mask * float(a))
        logprobs = torch.as_tensor(list(comp.logprobs), dtype=torch.float32)
        if logprobs.numel() != lr:  # an engine that reports no log-probs
            logprobs = torch.zeros(lr)
        rollout_lp.append(torch.cat([torch.zeros(lp), logprobs]))
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
    )
