"""Continuous batching for the transformers engine: slots, admission, decode, compaction.

Why not fixed batches: GRPO responses differ in length by 10x, so a fixed batch decodes mostly
finished rows by its end. Here a finished sequence frees its KV-cache slot at once and the next
waiting request takes it (prefilled, then it joins the decode batch), so the decode batch stays
full while work remains. Admission waits until a few slots are free (``admit_min``), because
one prefill forward costs about as much for one prompt as for several. When nothing waits and
the live sequences no longer fill their batch bucket, live slots move to the front (a KV copy)
so the step reads a smaller bucket.

The scheduler is host bookkeeping only: what runs on the device is given as two callables
(``prefill`` and ``decode``), which keeps it testable and the device code in one place.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rollout_sglang.types import GenerateRequest

logger = logging.getLogger(__name__)


@dataclass
class SeqState:
    """One request's progress. ``tokens``/``logprobs`` grow as it decodes."""

    index: int  # position in the generate call, names it in errors
    request: GenerateRequest
    seed: int
    limit: int  # new tokens at most (max_new_tokens clipped to the context)
    slot: int = -1
    rope_next: int = 0  # rotary position of the first generated token (M-RoPE delta applied)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None

    @property
    def name(self) -> str:
        rid = self.request.request_id
        return f"request {self.index}" + (f" ({rid})" if rid else "")

    @property
    def prompt_length(self) -> int:
        return self.request.prompt_length

    @property
    def cache_tokens(self) -> int:
        """Cache cells it may use: the prompt and every generated token but the last."""
        return self.prompt_length + self.limit - 1


PrefillFn = Callable[[list[SeqState], list[int]], list[tuple[int, float]]]
DecodeFn = Callable[[torch.Tensor, int], tuple[list[int], list[float]]]
MoveFn = Callable[[list[int], list[int]], None]


def batch_bucket(n: int, slots: int) -> int:
    """Batch sizes graphs are captured for: powers of two to 8, then multiples of 16."""
    bucket = 1 << max(n - 1, 0).bit_length() if n <= 8 else -(-n // 16) * 16
    return min(bucket, slots)


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


class Scheduler:
    """Drives ``sequences`` to completion over ``slots`` cache slots.

    Args:
        prefill: runs prompts into the given slots and returns each one's first (token,
            log-prob); sets ``rope_next``. May raise: the batch is retried one by one so only
            the failing request gets an error.
        decode: one step for slots ``0..B-1`` from a ``[5, B]`` int64 host state (token,
            rotary position, cache index, seed, counter per slot) and a KV bound.
        move: copies cache slots ``src`` to ``dst`` (compaction).
        stop_ids: tokens that end a sequence (kept in its output).
        kv_block: KV-length bucket granularity; ``seq_cap`` bounds it.
        prefill_tokens: padded prompt tokens per prefill forward at most.
        admit_min: free slots worth a prefill while others decode.
    """

    def __init__(
        self,
        *,
        slots: int,
        seq_cap: int,
        prefill: PrefillFn,
        decode: DecodeFn,
        move: MoveFn,
        stop_ids: set[int],
        kv_block: int,
        prefill_tokens: int,
        admit_min: int,
    ) -> None:
        self.slots, self.seq_cap = slots, seq_cap
        self.prefill, self.decode, self.move = prefill, decode, move
        self.stop_ids = stop_ids
        self.kv_block, self.prefill_tokens = kv_block, prefill_tokens
        self.admit_min = max(1, admit_min)
        self.steps = 0
        self.prefills = 0

    def run(self, sequences: Sequence[SeqState]) -> None:
        waiting = deque(sequences)
        free = list(range(self.slots))
        heapq.heapify(free)
        active: dict[int, SeqState] = {}
        while waiting or active:
            n_free = len(free)
            if (
                waiting
                and n_free
                and (not active or n_free >= self.admit_min or len(waiting) <= n_free)
            ):
                admitted = [waiting.popleft() for _ in range(min(n_free, len(waiting)))]
                for seq in admitted:
                    seq.slot = heapq.heappop(free)
                for seq in self._prefill(admitted):
                    if self._done(seq):
                        heapq.heappush(free, seq.slot)
                    else:
                        active[seq.slot] = seq
                continue
            if not active:
                continue
            self._step(active, free)
            if not waiting:
                self._compact(active, free)

    def _prefill(self, admitted: list[SeqState]) -> list[SeqState]:
        """Prefill in chunks of similar length; returns the sequences that started."""
        admitted = sorted(admitted, key=lambda s: s.prompt_length)
        started: list[SeqState] = []
        chunk: list[SeqState] = []
        for seq in admitted:
            width = max(seq.prompt_length, *(s.prompt_length for s in chunk)) if chunk else 0
            if chunk and width * (len(chunk) + 1) > self.prefill_tokens:
                started += self._prefill_isolated(chunk)
                chunk = []
            chunk.append(seq)
        if chunk:
            started += self._prefill_isolated(chunk)
        return started

    def _prefill_isolated(self, chunk: list[SeqState]) -> list[SeqState]:
        self.prefills += 1
        try:
            firsts = self.prefill(chunk, [s.slot for s in chunk])
        except Exception as exc:
            if len(chunk) > 1:
                logger.warning("prefill of %d failed (%s); retrying one by one", len(chunk), exc)
                return [s for seq in chunk for s in self._prefill_isolated([seq])]
            seq = chunk[0]
            seq.error = f"{seq.name}: prefill failed: {type(exc).__name__}: {exc}"
            logger.warning(seq.error)
            return [seq]
        for seq, (token, logprob) in zip(chunk, firsts, strict=True):
            self._record(seq, token, logprob)
        return chunk

    def _record(self, seq: SeqState, token: int, logprob: float) -> None:
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.stopped = token in self.stop_ids

    @staticmethod
    def _done(seq: SeqState) -> bool:
        return seq.error is not None or seq.stopped or len(seq.tokens) >= seq.limit

    def _step(self, active: dict[int, SeqState], free: list[int]) -> None:
        batch = batch_bucket(max(active) + 1, self.slots)
        rows = [[0] * batch for _ in range(5)]  # idle slots: token 0 at cache index 0
        kv_len = 0
        for slot, seq in active.items():
            n = len(seq.tokens)
            length = seq.prompt_length + n - 1  # cache index of the last token
            rows[0][slot], rows[1][slot], rows[2][slot] = (
                seq.tokens[-1],
                seq.rope_next + n - 1,
                length,
            )
            rows[3][slot], rows[4][slot] = seq.seed, n
            kv_len = max(kv_len, length + 1)
        state = torch.tensor(rows, dtype=torch.long)
        kv_len = min(round_up(kv_len, self.kv_block), self.seq_cap)
        self.steps += 1
        try:
            tokens, logprobs = self.decode(state, kv_len)
        except Exception as exc:
            logger.warning("decode step failed: %s: %s", type(exc).__name__, exc)
            for slot, seq in list(active.items()):
                seq.error = f"{seq.name}: decode failed: {type(exc).__name__}: {exc}"
                del active[slot]
                heapq.heappush(free, slot)
            return
        for slot, seq in list(active.items()):
            self._record(seq, tokens[slot], logprobs[slot])
            if self._done(seq):
                del active[slot]
                heapq.heappush(free, slot)

    def _compact(self, active: dict[int, SeqState], free: list[int]) -> None:
        """Move the live sequences into the lowest slots when that shrinks the batch bucket."""
        n = len(active)
        if not n or batch_bucket(max(active) + 1, self.slots) <= batch_bucket(n, self.slots):
            return
        movers = sorted(s for s in active if s >= n)
        holes = sorted(s for s in free if s < n)
        self.move(movers, holes)
        for src, dst in zip(movers, holes, strict=True):
            seq = active.pop(src)
            seq.slot = dst
            active[dst] = seq
        free[:] = [s for s in range(self.slots) if s not in active]
        heapq.heapify(free)
