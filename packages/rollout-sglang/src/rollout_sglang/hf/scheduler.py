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
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
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
    tokens: list[int] = field(default_factory=list)  # filled when it finishes
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None
    # routing replay: the experts each prompt token was routed to ([P, layers, k], set by the
    # prefill) and each consumed response token ([R - 1, layers, k], set when it finishes)
    prompt_routing: np.ndarray | None = None
    decode_routing: np.ndarray | None = None

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
# (tokens, log-probs) or (tokens, log-probs, routing [B, layers, k] or None)
DecodeFn = Callable[[torch.Tensor, int], tuple[np.ndarray, ...]]
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
        self.prefill_s = 0.0  # wall time in prefill and decode calls (each reads the device)
        self.decode_s = 0.0

    def run(self, sequences: Sequence[SeqState]) -> None:
        # Per-slot state as arrays, updated in place each step (no per-row Python work for
        # rows that continue): the decode inputs [5, slots] (last token, rotary position,
        # cache index, seed, counter; zeros in idle slots), and the tokens so far.
        width = max((s.limit for s in sequences), default=1)
        self._state = np.zeros((5, self.slots), dtype=np.int64)
        self._tokens = np.zeros((self.slots, width), dtype=np.int64)
        self._logprobs = np.zeros((self.slots, width), dtype=np.float64)
        self._count = np.zeros(self.slots, dtype=np.int64)
        self._width = width
        self._routing: np.ndarray | None = None  # [slots, width, layers, k] once a step has it
        self._limit = np.zeros(self.slots, dtype=np.int64)
        self._stop = np.array(sorted(self.stop_ids), dtype=np.int64)
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
                    if seq.error is None and self._start(seq):
                        active[seq.slot] = seq
                    else:
                        heapq.heappush(free, seq.slot)
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
            firsts = self._timed_prefill(chunk)
        except Exception as exc:
            if len(chunk) > 1:
                logger.warning("prefill of %d failed (%s); retrying one by one", len(chunk), exc)
                return [s for seq in chunk for s in self._prefill_isolated([seq])]
            seq = chunk[0]
            seq.error = f"{seq.name}: prefill failed: {type(exc).__name__}: {exc}"
            logger.warning(seq.error)
            return [seq]
        for seq, (token, logprob) in zip(chunk, firsts, strict=True):
            seq.tokens, seq.logprobs = [token], [logprob]
            seq.stopped = token in self.stop_ids
        return chunk

    def _timed_prefill(self, chunk: list[SeqState]) -> list[tuple[int, float]]:
        start = time.perf_counter()
        try:
            return self.prefill(chunk, [s.slot for s in chunk])
        finally:
            self.prefill_s += time.perf_counter() - start

    def _start(self, seq: SeqState) -> bool:
        """Put a prefilled sequence into its slot's arrays; False when it is already done."""
        if seq.stopped or seq.limit <= 1:
            return False
        slot = seq.slot
        self._tokens[slot, 0], self._logprobs[slot, 0] = seq.tokens[0], seq.logprobs[0]
        self._count[slot], self._limit[slot] = 1, seq.limit
        self._state[:, slot] = (seq.tokens[0], seq.rope_next, seq.prompt_length, seq.seed, 1)
        return True

    def _finish(self, seq: SeqState, stopped: bool) -> None:
        slot, n = seq.slot, int(self._count[seq.slot])
        seq.tokens = self._tokens[slot, :n].tolist()
        seq.logprobs = self._logprobs[slot, :n].tolist()
        if self._routing is not None:  # the last token was never an input: n - 1 rows
            seq.decode_routing = self._routing[slot, : n - 1].copy()
        seq.stopped = stopped
        self._state[:, slot] = 0

    def _step(self, active: dict[int, SeqState], free: list[int]) -> None:
        batch = batch_bucket(max(active) + 1, self.slots)
        rows = np.fromiter(active, dtype=np.int64, count=len(active))
        kv_len = int(self._state[2, rows].max()) + 1
        kv_len = min(round_up(kv_len, self.kv_block), self.seq_cap)
        self.steps += 1
        start = time.perf_counter()
        try:
            out = self.decode(
                torch.from_numpy(np.ascontiguousarray(self._state[:, :batch])), kv_len
            )
        except Exception as exc:
            logger.warning("decode step failed: %s: %s", type(exc).__name__, exc)
            for slot in rows.tolist():
                seq = active.pop(slot)
                seq.error = f"{seq.name}: decode failed: {type(exc).__name__}: {exc}"
                self._state[:, slot] = 0
                heapq.heappush(free, slot)
            return
        finally:
            self.decode_s += time.perf_counter() - start
        tokens, logprobs = np.asarray(out[0])[rows], np.asarray(out[1])[rows]
        count = self._count[rows]
        routing = out[2] if len(out) > 2 else None
        if routing is not None:  # this step's inputs are tokens count - 1
            if self._routing is None:
                shape = (self.slots, self._width, *routing.shape[1:])
                self._routing = np.zeros(shape, dtype=routing.dtype)
            self._routing[rows, count - 1] = routing[rows]
        self._tokens[rows, count] = tokens
        self._logprobs[rows, count] = logprobs
        count += 1
        self._count[rows] = count
        stopped = np.isin(tokens, self._stop)
        done = stopped | (count >= self._limit[rows])
        live = rows[~done]
        self._state[0, live] = tokens[~done]
        self._state[1:3, live] += 1
        self._state[4, live] += 1
        for slot, stop in zip(rows[done].tolist(), stopped[done].tolist(), strict=True):
            self._finish(active.pop(slot), stop)
            heapq.heappush(free, slot)

    def _compact(self, active: dict[int, SeqState], free: list[int]) -> None:
        """Move the live sequences into the lowest slots when that shrinks the batch bucket."""
        n = len(active)
        if not n or batch_bucket(max(active) + 1, self.slots) <= batch_bucket(n, self.slots):
            return
        movers = sorted(s for s in active if s >= n)
        holes = sorted(s for s in free if s < n)
        self.move(movers, holes)
        src, dst = np.array(movers), np.array(holes)
        arrays = [self._tokens, self._logprobs, self._count, self._limit]
        for array in arrays + ([] if self._routing is None else [self._routing]):
            array[dst] = array[src]
        self._state[:, dst] = self._state[:, src]
        self._state[:, src] = 0
        for old, new in zip(movers, holes, strict=True):
            seq = active.pop(old)
            seq.slot = new
            active[new] = seq
        free[:] = [s for s in range(self.slots) if s not in active]
        heapq.heapify(free)
