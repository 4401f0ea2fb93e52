"""Data-parallel rollout: several engines behind one :class:`RolloutEngine`.

A ``generate`` call is split across the engines and the parts run concurrently (threads: the
engines do their work in other processes or release the GIL in kernels). Two policies:

- ``"round_robin"``: contiguous, near-equal slices, the first slice going to the next engine in
  turn. Contiguous slices keep a prompt's GRPO group on one engine, where its shared prefix
  (and image) is cached once.
- ``"least_loaded"``: each request goes to the engine with the fewest tokens in flight
  (prompt + max_new_tokens), counting work from concurrent calls too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rollout_sglang.config import Policy
from rollout_sglang.sglang_client.protocol import with_sample_seeds
from rollout_sglang.types import (
    Completion,
    GenerateRequest,
    NamedTensors,
    RolloutEngine,
    SamplingParams,
)

logger = logging.getLogger(__name__)


class EngineRouter:
    """A :class:`RolloutEngine` that spreads requests over ``engines``."""

    name = "router"

    def __init__(self, engines: Sequence[RolloutEngine], policy: Policy = "round_robin") -> None:
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        if policy not in ("round_robin", "least_loaded"):
            raise ValueError(f"unknown router policy {policy!r}: round_robin or least_loaded")
        self.engines = list(engines)
        self.policy = policy
        self.in_flight = [0] * len(self.engines)  # tokens being generated, per engine
        self._next = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines))
        logger.info("rollout router: %d engines, %s", len(self.engines), policy)

    def assign(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[list[int]]:
        """Request indices per engine (and, for least_loaded, reserves their load)."""
        n_engines = len(self.engines)
        parts: list[list[int]] = [[] for _ in range(n_engines)]
        with self._lock:
            if self.policy == "round_robin":
                base, extra = divmod(len(requests), n_engines)
                start = 0
                for k in range(n_engines):
                    engine = (self._next + k) % n_engines
                    size = base + (k < extra)
                    parts[engine] = list(range(start, start + size))
                    start += size
                self._next = (self._next + 1) % n_engines
            else:
                for i, request in enumerate(requests):
                    engine = min(range(n_engines), key=lambda e: (self.in_flight[e], e))
                    parts[engine].append(i)
                    self.in_flight[engine] += request.prompt_length + params.max_new_tokens
        return parts

    def generate(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        requests = with_sample_seeds(requests, params)  # seeds by position before the split
        parts = self.assign(requests, params)
        futures = {
            e: self._pool.submit(self._run, e, [requests[i] for i in part], params)
            for e, part in enumerate(parts)
            if part
        }
        results: list[Completion | None] = [None] * len(requests)
        for e, future in futures.items():
            for i, completion in zip(parts[e], future.result(), strict=True):
                results[i] = completion
        return results  # type: ignore[return-value]

    def _run(
        self, engine: int, requests: list[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        try:
            return self.engines[engine].generate(requests, params)
        except Exception as exc:
            message = f"engine {engine} failed: {type(exc).__name__}: {exc}"
            logger.error(message)
            return [
                Completion.failed(message, prompt_length=r.prompt_length, request_id=r.request_id)
                for r in requests
            ]
        finally:
            if self.policy == "least_loaded":
                with self._lock:
                    self.in_flight[engine] -= sum(
                        r.prompt_length + params.max_new_tokens for r in requests
                    )

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Each bucket goes to every engine (concurrently) before the next bucket is read."""
        for bucket in buckets:
            for future in [self._pool.submit(e.update_weights, [bucket]) for e in self.engines]:
                future.result()

    def update_weights_from_serialized(
        self, names: list[str], payloads: list[str], load_format: str = "flattened_bucket"
    ) -> None:
        """One serialized bucket (CUDA IPC handles, ``weight_sync.cuda_ipc``) to every
        engine, inside the session the caller opened on each."""
        futures = [
            self._pool.submit(e.update_weights_from_serialized, names, payloads, load_format)
            for e in self.engines
        ]
        for future in futures:
            future.result()

    def _all(self, method: str) -> list[object]:
        futures = [self._pool.submit(getattr(e, method)) for e in self.engines]
        return [f.result() for f in futures]

    def release_memory(self) -> None:
        self._all("release_memory")

    def begin_weight_update(self) -> None:
        self._all("begin_weight_update")

    def end_weight_update(self) -> None:
        self._all("end_weight_update")

    def flush_cache(self) -> None:
        self._all("flush_cache")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        futures = [self._pool.submit(e.resume_memory, tags) for e in self.engines]
        for future in futures:
            future.result()

    def health(self) -> bool:
        return all(self._all("health"))

    def shutdown(self) -> None:
        self._all("shutdown")
        self._pool.shutdown()
