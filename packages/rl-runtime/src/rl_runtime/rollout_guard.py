"""A rollout that cannot run stops the run, before any update, with one line.

An engine returns a failed completion for a request it cannot serve, and the loop drops it and
goes on: right for bad input (a prompt over the engine's limit, an image that does not match its
placeholders), which is skipped and counted. Two failures are not bad input, and going on would
train on nothing, or only on what happens to be short, while the run looks alive:

- **capacity**: the engine's KV cache cannot hold a request that fits the model. The
  transformers engine clips each response so that prompt + response fit the model's context,
  so a request it refuses for the cache (``needs N KV-cache tokens, the cache holds M``, the
  words matched by :data:`CAPACITY`) would run with a larger cache. One such request stops the
  run: the settings are wrong for this model and data, and every later step would drop the
  same long prompts. (On a GPU shared with a colocated trainer the cache is sized, at each
  rollout, from what the trainer leaves free: once it held 1 token.)
- **nothing generated**: the rollout returned no token at all (every request failed, whatever
  the reason). No step learns from zero samples; a silent one, repeated, ends a run at exit
  status 0 having trained nothing.

Either raises :class:`~rl_runtime.faults.RolloutFailed`, whose line (with the checkpoint
``--resume`` continues from, added by ``stop_with_checkpoint_note``) the launchers print before
exiting 1. A few requests failing for bad input, with tokens from the rest, go on as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from rl_runtime.faults import RolloutFailed
from rl_runtime.rollout_batch import usable

#: A capacity error in an engine's words (``rollout_sglang.hf.engine.HFEngine.generate``):
#: the cache tokens a request needs, and what the cache holds.
CAPACITY = re.compile(r"needs (\d+) KV-cache tokens, the cache holds (\d+)")

#: What to change when the engine's cache cannot hold the requests: its memory, the responses'
#: length, the memory a colocated trainer keeps on the GPU while the engines generate.
CAPACITY_SETTINGS = (
    "give the KV cache more memory (--kv-cache-fraction or --rollout-cache-tokens for the "
    "transformers engine, --sglang-mem-fraction-static for SGLang), shorten the responses "
    "(--rollout-max-response-len {max_response_len}) or the prompts (--max-prompt-length), "
    "or leave the engine more of a GPU it shares with the trainer (--offload-train, a higher "
    "--optimizer-offload-fraction, more GPUs)"
)


def capacity_figures(completion: Any) -> tuple[int, int] | None:
    """(tokens needed, tokens the cache holds) of a completion the engine failed for its
    cache's size, else None."""
    found = CAPACITY.search(getattr(completion, "error", None) or "")
    return None if found is None else (int(found[1]), int(found[2]))


def rollout_problem(completions: Sequence[Any], max_response_len: int) -> str | None:
    """Why this rollout stops the run, in words, or None when it may go on.

    A request the cache cannot hold (:func:`capacity_figures`) stops it, the largest named; so
    does a rollout of requests that returned no token at all, naming the first error."""
    n = len(completions)
    if not n:
        return None
    settings = CAPACITY_SETTINGS.format(max_response_len=max_response_len)
    too_big = [(f, c) for c in completions if (f := capacity_figures(c)) is not None]
    if too_big:
        worst = max(too_big, key=lambda fc: fc[0][0])[1]
        return (
            f"the rollout engine's KV cache cannot hold {len(too_big)} of {n} requests that fit "
            f"the model; the largest: {worst.error}: {settings}"
        )
    if any(getattr(c, "token_ids", None) for c in completions):
        return None
    failed = [c for c in completions if not usable(c)]
    if not failed:
        return f"the rollout returned no tokens: all {n} responses are empty"
    return (
        f"the rollout returned no tokens: {len(failed)} of {n} requests failed (the first: "
        f"{failed[0].error or failed[0].finish_reason}); if the engine ran short of memory: "
        f"{settings}"
    )


def check_rollout(
    groups: Iterable[Sequence[Any]], *, where: str, ending: str, max_response_len: int
) -> None:
    """Raise :class:`RolloutFailed` when ``groups`` (a rollout's completions, per prompt) stop
    the run (:func:`rollout_problem`): ``<where>: <why>; <ending>``."""
    problem = rollout_problem([c for group in groups for c in group], max_response_len)
    if problem is not None:
        raise RolloutFailed(f"{where}: {problem}; {ending}")
