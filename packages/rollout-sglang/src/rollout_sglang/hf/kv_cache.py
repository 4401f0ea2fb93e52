"""The transformers engine's KV cache: one preallocated block, carved into per-request slots.

Why per-slot and not paged: decode attention here is a plain batched read of
``keys[:batch, :, :kv_bucket]`` (SDPA or a matmul over a strided view, no gather; the Triton
kernel streams each slot's own prefix), which needs each slot's tokens contiguous and the live
slots at the front. One allocation holds ``budget_tokens`` tokens; a layout ``(slots,
seq_cap)`` views it as ``[layers, slots, kv_heads, seq_cap, head_dim]``. ``seq_cap`` only grows
(a longer request reshapes the view and costs the captured CUDA graphs), so a run with steady
lengths keeps one layout and its graphs.

Its size (:func:`cache_size`) is settled at each allocation (the first, and each after a
release, colocated): a planned number of tokens where one is given (the colocation plan's,
``rl_runtime.ColocationPlan.kv_cache_tokens``, as the engine's ``cache_tokens``), checked
against the memory free then, so that a colocated trainer holding more than the plan counts is
one clear error; else ``mem_fraction`` of the free memory (like SGLang's
``mem_fraction_static``), which shrinks with whatever another process on the GPU keeps. Each
allocation logs one line: the tokens, and where the number came from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)
#: the allocation's line, at each allocation (a colocated run's every resume): shown at INFO
#: by the workers (``rl_runtime.workers.MEMORY_LOGGER``), as the trainers' ``release_cache``
memory_logger = logging.getLogger("glimpse.memory")


GiB = 1 << 30


@dataclass(frozen=True)
class CacheSize:
    """What :func:`cache_size` settled: ``tokens`` of KV cache; ``slots``, the sequences whose
    recurrent states (Qwen3.5) were set aside when fewer than the engine's batch (None: as
    many as it asks); ``how``, one phrase for the allocation's log line."""

    tokens: int
    how: str
    slots: int | None = None


class KVCacheTooSmall(RuntimeError):
    """The planned cache does not fit the memory free when it is taken."""


def cache_size(
    *,
    device: torch.device,
    bytes_per_token: int,
    mem_fraction: float,
    cpu_tokens: int,
    planned_tokens: int | None = None,
    slot_bytes: int = 0,
    max_slots: int = 0,
) -> CacheSize:
    """The cache's size at an allocation; see the module docstring.

    ``planned_tokens`` (the engine's ``cache_tokens``): that many, on a GPU only when the free
    memory holds them and ``max_slots`` slots' recurrent states (``slot_bytes`` each), else
    :class:`KVCacheTooSmall` naming both; a plan that the memory left does not hold is a
    colocated process keeping more than it counts. Without one: on a GPU ``mem_fraction`` of
    the free memory, of which the slots' states take at most half (beyond that, states are set
    aside for fewer slots, and the rollout runs in more turns rather than not at all: 256
    slots of the Qwen3.5-35B-A3B 8-layer cut's states are 3.1 GiB); elsewhere ``cpu_tokens``
    (CPU tests; host memory is not worth sizing)."""
    if device.type != "cuda":
        if planned_tokens:
            return CacheSize(planned_tokens, "cache_tokens (planned)")
        return CacheSize(cpu_tokens, f"the fixed size on {device.type} (cache_tokens unset)")
    free, total = torch.cuda.mem_get_info(device)
    states = max_slots * slot_bytes
    state_note = ""
    if states:
        state_note = f" and {states / GiB:.2f} GiB of {max_slots} slots' recurrent states"
    if planned_tokens:
        need = planned_tokens * bytes_per_token + states
        if need > free:
            raise KVCacheTooSmall(
                f"KV cache: the planned {planned_tokens} tokens "
                f"({planned_tokens * bytes_per_token / GiB:.2f} GiB){state_note} need "
                f"{need / GiB:.2f} GiB, but {free / GiB:.2f} of the {total / GiB:.1f} GiB of "
                f"{device} are free: another process on it (a colocated trainer: its "
                "'release_cache' log line says what it keeps against the plan) holds more "
                "than the plan counts. Give the engine fewer tokens (--rollout-cache-tokens) "
                "or batch slots (--rollout-max-batch-size), or offload the trainer "
                "(--offload-train)"
            )
        return CacheSize(
            planned_tokens,
            f"as planned (cache_tokens); {free / GiB:.2f} GiB were free, {need / GiB:.2f} taken "
            f"with{state_note or ' no recurrent states'}",
        )
    budget = int(free * mem_fraction)
    slots = None
    if slot_bytes and states > budget // 2:
        slots = max(1, budget // 2 // slot_bytes)
        states = slots * slot_bytes
    tokens = max((budget - states) // bytes_per_token, 1)
    how = f"kv_cache_fraction {mem_fraction:g} of {free / GiB:.2f} GiB free"
    if slot_bytes:
        how += f", less {states / GiB:.2f} GiB of recurrent states for {slots or max_slots} slots"
        if slots is not None:
            how += f" (of {max_slots}: the states may take half)"
    return CacheSize(tokens, how + "; no planned size (cache_tokens unset)", slots)


class KVCache:
    """Keys and values of every language-model layer, for ``slots`` sequences of up to
    ``seq_cap`` tokens. ``keys[layer]`` is ``[slots, kv_heads, seq_cap, head_dim]``.

    ``states``: per-slot states of layers that keep no keys (Qwen3.5's gated-delta-net:
    :class:`~rollout_sglang.hf.linear_attention_decode.LinearStates`), sized, moved and
    released with the slots."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_tokens: int | Callable[[], int | CacheSize],
        states: Any = None,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # a number, or a function asked at each allocation (the memory free then)
        self._budget = budget_tokens
        self.budget_tokens = budget_tokens if isinstance(budget_tokens, int) else 0
        self.slot_limit: int | None = None  # slots whose recurrent states were set aside
        self.sized = "a fixed size"  # where budget_tokens came from (the allocation's log)
        self._storage: Tensor | None = None
        self.slots = 0
        self.seq_cap = 0
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.states = states

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def allocated(self) -> bool:
        return self._storage is not None

    def allocate(self) -> None:
        """Take the memory (once; again after :meth:`release`)."""
        if self._storage is None:
            if callable(self._budget):
                size = self._budget()
                if not isinstance(size, CacheSize):
                    size = CacheSize(size, "a size given")
                self.budget_tokens, self.slot_limit, self.sized = size.tokens, size.slots, size.how
            per_token = 2 * self.num_layers * self.kv_heads * self.head_dim
            # zeros, not empty: attention multiplies masked-out cells by 0, and reused device
            # memory can hold NaN bit patterns (0 * NaN is NaN)
            self._storage = torch.zeros(
                self.budget_tokens * per_token, dtype=self.dtype, device=self.device
            )
            gib = self._storage.numel() * self._storage.element_size() / 2**30
            memory_logger.info(
                "KV cache: %d tokens (%.2f GiB) on %s: %s",
                self.budget_tokens,
                gib,
                self.device,
                self.sized,
            )
            self.slots = self.seq_cap = 0
            self.keys = self.values = None

    def release(self) -> None:
        """Give the memory back (colocated training); :meth:`allocate` takes it again."""
        self._storage = self.keys = self.values = None
        self.slots = self.seq_cap = 0
        if self.states is not None:
            self.states.release()

    def fit(self, seq_cap: int, max_slots: int) -> bool:
        """Make room for sequences of ``seq_cap`` tokens (rounded up by the caller). Returns
        True when the layout changed (views moved: captured graphs are stale)."""
        self.allocate()
        seq_cap = max(seq_cap, self.seq_cap)
        if self.slot_limit is not None:  # no more slots than states were set aside for
            max_slots = min(max_slots, self.slot_limit)
        slots = min(max_slots, self.budget_tokens // seq_cap) if seq_cap else 0
        if (slots, seq_cap) == (self.slots, self.seq_cap):
            return False
        if slots < 1:
            raise ValueError(
                f"KV cache holds {self.budget_tokens} tokens, fewer than one sequence of {seq_cap}"
            )
        assert self._storage is not None
        shape = (self.num_layers, slots, self.kv_heads, seq_cap, self.head_dim)
        n = self.num_layers * slots * self.kv_heads * seq_cap * self.head_dim
        self.keys = self._storage[:n].view(shape)
        self.values = self._storage[n : 2 * n].view(shape)
        self.slots, self.seq_cap = slots, seq_cap
        if self.states is not None:
            self.states.fit(slots)
        logger.info("KV cache layout: %d slots x %d tokens", slots, seq_cap)
        return True

    def write_prefill(self, layer: int, slots: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store a right-padded prefill's ``[B, kv_heads, W, head_dim]`` keys/values at
        positions ``0..W-1`` of ``slots`` (pad positions are overwritten by decode later and
        masked until then)."""
        assert self.keys is not None and self.values is not None
        width = keys.shape[2]
        self.keys[layer, slots, :, :width] = keys.to(self.dtype)
        self.values[layer, slots, :, :width] = values.to(self.dtype)

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Copy whole slots ``src`` into ``dst`` (all layers): compaction, so live sequences
        stay at the front and decode reads a smaller batch bucket."""
        assert self.keys is not None and self.values is not None
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]
        if self.states is not None:
            self.states.move(src, dst)
