"""How the engine runs the decode step: :class:`DecodeRunner` feeds
:class:`~rollout_sglang.hf.decode.TextDecoder` from static per-slot buffers and captures and
replays it as CUDA graphs (or runs it eagerly), with a first dry run that turns off what fails
to build on this machine. Apart from :mod:`~rollout_sglang.hf.decode` because the step is the
model's arithmetic, and this is how it is launched: buffers, graphs, their memory pool and the
device time they take, none of which the step's ops (or the microscope's eager trace) need.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollout_sglang.hf.decode import TextDecoder
from rollout_sglang.hf.kv_cache import KVCache
from rollout_sglang.hf.sampling import SamplingKey


class DecodeRunner:
    """Runs :meth:`TextDecoder.step` for the first ``B`` slots, eagerly or as CUDA graphs.

    Inputs live in static buffers (``state``: tokens, positions, lengths, seeds, counters per
    slot) that the host fills each step with one copy; outputs land in static buffers too. With
    graphs on, the first step of each (batch bucket, KV bucket, sampling) key captures one
    graph (all graphs share one memory pool), later steps replay it. A KV-cache layout change,
    or memory released, invalidates them (:meth:`reset`).
    """

    def __init__(
        self,
        decoder: TextDecoder,
        cache: KVCache,
        device: torch.device,
        *,
        use_graphs: bool,
        record_routing: bool = False,
    ) -> None:
        self.decoder, self.cache, self.device = decoder, cache, device
        self.use_graphs = use_graphs and device.type == "cuda"
        # return each step's MoE routing (``TextDecoder.routing``; routing replay)
        self.record_routing = record_routing
        self.out_routing: Tensor | None = None
        self._graphs: dict[tuple[int, int, SamplingKey], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self.state: Tensor | None = None  # [5, slots] int64
        self.out_tokens: Tensor | None = None
        self.out_logprobs: Tensor | None = None
        self.captures = 0  # graphs captured and the wall time it took, since construction
        self.capture_s = 0.0
        # device time of the decode steps (CUDA events around each step, read after the
        # step's own sync): beside the scheduler's wall time it says whether a slow step is
        # the GPU's work or the host's
        self.device_s = 0.0
        self._probed = False

    def reset(self) -> None:
        """Forget captured graphs and buffers (cache layout changed or memory released)."""
        self._graphs.clear()
        self._pool = None
        self.state = self.out_tokens = self.out_logprobs = self.out_routing = None
        self.decoder.routing = None

    def _buffers(self) -> None:
        if self.state is None or self.state.shape[1] != self.cache.slots:
            self.reset()
            slots = self.cache.slots
            self.state = torch.zeros((5, slots), dtype=torch.long, device=self.device)
            self.out_tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
            self.out_logprobs = torch.zeros(slots, dtype=torch.float32, device=self.device)
            shape = self.decoder.routing_shape
            if self.record_routing and shape is not None:
                # int16: expert ids < 32768; what the graphs write, so set before a capture
                self.out_routing = torch.zeros(
                    (slots, *shape), dtype=torch.int16, device=self.device
                )
                self.decoder.routing = self.out_routing

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _body(self, batch: int, kv_len: int, sampling: SamplingKey) -> None:
        assert self.state is not None and self.out_tokens is not None
        assert self.out_logprobs is not None
        state = self.state[:, :batch]
        tokens, logprobs = self.decoder.step(
            self.cache,
            tokens=state[0],
            positions=state[1],
            lengths=state[2],
            seeds=state[3],
            counters=state[4],
            kv_len=kv_len,
            sampling=sampling,
        )
        self.out_tokens[:batch].copy_(tokens)
        self.out_logprobs[:batch].copy_(logprobs)

    def run(
        self, host_state: Tensor, kv_len: int, sampling: SamplingKey
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """One step for the first ``host_state.shape[1]`` slots (``host_state``: [5, B] int64
        on the host). Returns the sampled tokens and log-probs ([B] host arrays) and, when
        recording, the experts each row's input token was routed to ([B, layers, k])."""
        self._buffers()
        assert self.state is not None and self.out_tokens is not None
        assert self.out_logprobs is not None
        batch = host_state.shape[1]
        cuda = self.device.type == "cuda"
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        self.state[:, :batch].copy_(host_state, non_blocking=True)
        if not self.use_graphs:
            if not self._probed:  # once: what fails to build falls back before a real step
                self._probe(batch, kv_len, sampling)
                self._probed = True
            self._body(batch, kv_len, sampling)
        else:
            key = (batch, kv_len, sampling)
            graph = self._graphs.get(key)
            if graph is None:
                start = time.perf_counter()
                graph = self._capture(batch, kv_len, sampling)
                self._graphs[key] = graph
                self.captures += 1
                self.capture_s += time.perf_counter() - start
            graph.replay()
        tokens = self.out_tokens[:batch].to("cpu", non_blocking=True)
        logprobs = self.out_logprobs[:batch].to("cpu", non_blocking=True)
        routing = None
        if self.out_routing is not None:
            routing = self.out_routing[:batch].to("cpu", non_blocking=True)
        if cuda:
            end.record()
            torch.cuda.current_stream(self.device).synchronize()
            self.device_s += begin.elapsed_time(end) / 1e3
        return tokens.numpy(), logprobs.numpy(), None if routing is None else routing.numpy()

    def _probe(self, batch: int, kv_len: int, sampling: SamplingKey) -> None:
        """The step as a dry run (:attr:`TextDecoder.dry_run`: Qwen3.5's gated-delta-net layers
        update copies of the slots' states, so running it leaves them as they were; the K/V
        it writes are the very ones the real step writes, in the same cells), with what may fail
        to build on this machine (compiled blocks, the Triton attention) turned off one at a
        time until it runs (:meth:`TextDecoder.fall_back`); graphs captured before stay valid
        (they replay kernels already built)."""
        self.decoder.dry_run = True
        try:
            while True:
                try:
                    self._body(batch, kv_len, sampling)
                    return
                except Exception as exc:
                    if not self.decoder.fall_back(exc):
                        raise
        finally:
            self.decoder.dry_run = False

    def _capture(self, batch: int, kv_len: int, sampling: SamplingKey) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (compiles, picks kernels), then capture. The warm-ups are dry
        # runs: the replay that follows is the step (Qwen3.5's recurrent states advance once).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._probe(batch, kv_len, sampling)
            self._probe(batch, kv_len, sampling)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._body(batch, kv_len, sampling)
        return graph
