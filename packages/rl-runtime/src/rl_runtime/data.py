"""Deterministic prompt sampling with a resumable position.

The order of epoch `e` is a permutation drawn from `(seed, e)`, so the whole sampler state is
three integers (epoch, cursor, skipped) and a resumed run draws exactly the prompts the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from rl_runtime.protocols import PromptSource

log = logging.getLogger(__name__)


@dataclass
class SamplerState:
    epoch: int = 0
    cursor: int = 0
    skipped: int = 0


class PromptSampler:
    """Draws batches of valid prompts from a `PromptSource`, epoch after epoch.

    Bad rows (`source.get(i)` is None) are skipped and counted; the batch is filled from the
    next rows. `shuffle=False` walks the rows in order (evaluation).
    """

    def __init__(self, source: PromptSource, *, seed: int = 0, shuffle: bool = True) -> None:
        if len(source) == 0:
            raise ValueError("the prompt source is empty")
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.state = SamplerState()
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.state.epoch:
            n = len(self.source)
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.state.epoch])
                self._order = rng.permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.state.epoch
        assert self._order is not None
        return self._order

    def next_batch(self, size: int) -> list[Any]:
        """`size` valid prompts (crossing epoch boundaries as needed)."""
        out: list[Any] = []
        misses = 0
        while len(out) < size:
            order = self._epoch_order()
            if self.state.cursor >= len(order):
                self.state.epoch += 1
                self.state.cursor = 0
                continue
            index = int(order[self.state.cursor])
            self.state.cursor += 1
            sample = self.source.get(index)
            if sample is None:
                self.state.skipped += 1
                misses += 1
                if misses > 2 * len(order):
                    raise RuntimeError("every row of the prompt source was skipped as bad")
                continue
            out.append(sample)
        return out

    @property
    def skipped_rows(self) -> int:
        """Rows skipped so far: bad rows drawn (each time drawn) and malformed lines of the
        data files (once; they never became rows)."""
        return self.state.skipped + self.source.malformed_lines

    def state_dict(self) -> dict[str, int]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SamplerState(**state)


class PromptPrefetch:
    """The next step's prompts, built in a background thread while this step trains.

    Building a batch (image decoding, the processor) is CPU work of the driver; the trainer and
    engines run in other processes, so it overlaps with log-probs, training and weight sync.
    The sampler is touched only by the prefetch while one is in flight, and
    :meth:`state_dict` gives its state from *before* the prefetch: a checkpoint taken then
    resumes with the prefetched batch, exactly as an uninterrupted run would draw it.
    """

    def __init__(self, sampler: PromptSampler, size: int) -> None:
        self.sampler = sampler
        self.size = size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")
        self._pending: Future[list[Any]] | None = None
        self._state_before: dict[str, int] | None = None

    def start(self) -> None:
        """Begin building the next batch (no-op if one is already in flight)."""
        if self._pending is None:
            self._state_before = self.sampler.state_dict()
            self._pending = self._pool.submit(self.sampler.next_batch, self.size)

    def take(self) -> list[Any]:
        """The next batch: the prefetched one if any (its error, if it failed), else built now."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else self.sampler.next_batch(self.size)

    def state_dict(self) -> dict[str, int]:
        """The sampler's state as of the last batch taken."""
        if self._pending is not None and self._state_before is not None:
            return dict(self._state_before)
        return self.sampler.state_dict()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending = None
