"""Score many responses at once: in-process for small batches, over worker processes for large.

Each worker process scores items in its main thread, where ``signal.setitimer`` can interrupt a
slow item after ``item_timeout_s`` (it scores 0). An item stuck inside one long C call cannot be
interrupted that way, so the whole batch also has a deadline, after which unfinished items score
0 and the pool is replaced. Workers are started with "spawn": forking a process that already runs
threads (Ray actors, data loaders) can deadlock.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence

from rewards_math.rewards import RewardFn, _reward_kwargs, build

logger = logging.getLogger(__name__)


class _ItemTimeout(BaseException):
    """Raised by the alarm; a BaseException so no ``except Exception`` in a library swallows it."""


def _on_alarm(signum, frame):
    raise _ItemTimeout


def _score_pairs(
    reward: RewardFn, pairs: Sequence[tuple[str, str]], item_timeout_s: float | None
) -> list[float]:
    """Score pairs in this process; with a timeout, this must run in a main thread."""
    if item_timeout_s:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
    scores = []
    try:
        for response, answer in pairs:
            try:
                if item_timeout_s:
                    signal.setitimer(signal.ITIMER_REAL, item_timeout_s)
                scores.append(float(reward(response, answer)))
            except _ItemTimeout:
                logger.warning(
                    "reward timed out after %.1fs on answer %.80r", item_timeout_s, answer
                )
                scores.append(0.0)
            except Exception:
                logger.warning("reward failed on answer %.80r", answer, exc_info=True)
                scores.append(0.0)
            finally:
                if item_timeout_s:
                    signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        if item_timeout_s:
            signal.signal(signal.SIGALRM, previous)
    return scores


def _warm_up() -> None:
    """Import sympy and math-verify in each worker before the first batch arrives. Ctrl-C is
    the parent's: a terminal signals the whole foreground group, and a worker would die of it
    with a traceback; the parent stops the pool (`BatchScorer.close`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from rewards_math.equivalence import is_equivalent

    is_equivalent("\\sqrt{8}", "2\\sqrt{2}")


def default_num_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


class BatchScorer:
    """A reward applied to batches, with a pool of worker processes kept between batches.

    ``reward`` is a name from ``REWARDS`` (options in ``reward_kwargs``) or a picklable
    ``(response, answer) -> float`` callable. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        reward: str | RewardFn = "math",
        *,
        num_workers: int | None = None,
        item_timeout_s: float = 2.0,
        min_pool_batch: int = 64,
        **reward_kwargs: float | bool,
    ) -> None:
        self.reward = build(reward, **reward_kwargs) if isinstance(reward, str) else reward
        self.num_workers = num_workers or default_num_workers()
        self.item_timeout_s = item_timeout_s
        self.min_pool_batch = min_pool_batch
        self._pool = None

    def __enter__(self) -> BatchScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _get_pool(self):
        if self._pool is None:
            ctx = mp.get_context("spawn")
            self._pool = ctx.Pool(self.num_workers, initializer=_warm_up)
        return self._pool

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        pairs = list(zip(responses, answers, strict=True))
        if len(pairs) < self.min_pool_batch or self.num_workers <= 1:
            return _score_pairs(self.reward, pairs, None)
        pool = self._get_pool()
        chunk = max(1, math.ceil(len(pairs) / (self.num_workers * 4)))
        chunks = [pairs[i : i + chunk] for i in range(0, len(pairs), chunk)]
        jobs = [
            pool.apply_async(_score_pairs, (self.reward, c, self.item_timeout_s)) for c in chunks
        ]
        # Backstop for items no alarm can interrupt: start-up slack plus every item timing out.
        rounds = math.ceil(len(pairs) / self.num_workers) + 1
        deadline = time.monotonic() + 60.0 + self.item_timeout_s * rounds
        scores: list[float] = []
        broken = False
        for job, c in zip(jobs, chunks, strict=True):
            try:
                scores.extend(job.get(timeout=max(0.0, deadline - time.monotonic())))
            except mp.TimeoutError:
                broken = True
                scores.extend([0.0] * len(c))
            except Exception:
                logger.warning(
                    "a reward worker failed; its %d items score 0", len(c), exc_info=True
                )
                scores.extend([0.0] * len(c))
        if broken:
            logger.warning(
                "reward batch passed its deadline; unfinished items score 0, pool restarted"
            )
            self.close()
        return scores


def score_batch(
    responses: Sequence[str],
    answers: Sequence[str],
    *,
    reward_type: str = "math",
    tolerance: float = 0.0,
    num_workers: int | None = None,
    item_timeout_s: float = 2.0,
    min_pool_batch: int = 64,
) -> list[float]:
    """Scores of ``responses`` against ``answers`` (same length), in order.

    Batches of ``min_pool_batch`` or more are spread over ``num_workers`` processes started for
    this call, each item bounded by ``item_timeout_s``; smaller ones are scored in-process. For
    repeated batches keep a ``BatchScorer`` open instead, so workers start once.
    """
    with BatchScorer(
        reward_type,
        num_workers=num_workers,
        item_timeout_s=item_timeout_s,
        min_pool_batch=min_pool_batch,
        **_reward_kwargs(reward_type, tolerance),
    ) as scorer:
        return scorer(responses, answers)
