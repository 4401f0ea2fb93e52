"""The transformers engine's KV cache: one preallocated block, carved into per-request slots.

Why per-slot and not paged: decode attention here is a plain batched read of
``keys[:batch, :, :kv_bucket]`` (SDPA or a matmul over a strided view, no gather; the Triton
kernel streams each slot's own prefix), which needs each slot's tokens contiguous and the live
slots at the front. One allocation, sized from free memory at each allocation (the first,
and each after a release; ``mem_fraction``, like SGLang's ``mem_fraction_static``), holds
``budget_tokens`` tokens; a layout ``(slots, seq_cap)`` views it as
``[layers, slots, kv_heads, seq_cap, head_dim]``. ``seq_cap`` only grows (a longer request
reshapes the view and costs the captured CUDA graphs), so a run with steady lengths keeps one
layout and its graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def cache_budget_tokens(
    *,
    device: torch.device,
    bytes_per_token: int,
    mem_fraction: float,
    cpu_tokens: int,
) -> int:
    """Tokens the cache holds: ``mem_fraction`` of the device's free memory (CUDA), or
    ``cpu_tokens`` elsewhere (CPU tests; host memory is not worth sizing)."""
    if device.type != "cuda":
        return cpu_tokens
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * mem_fraction) // bytes_per_token


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
        budget_tokens: int | Callable[[], int],
        states: Any = None,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # a number, or a function asked at each allocation (the memory free then)
        self._budget = budget_tokens
        self.budget_tokens = budget_tokens if isinstance(budget_tokens, int) else 0
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
                self.budget_tokens = self._budget()
            per_token = 2 * self.num_layers * self.kv_heads * self.head_dim
            # zeros, not empty: attention multiplies masked-out cells by 0, and reused device
            # memory can hold NaN bit patterns (0 * NaN is NaN)
            self._storage = torch.zeros(
                self.budget_tokens * per_token, dtype=self.dtype, device=self.device
            )
            gib = self._storage.numel() * self._storage.element_size() / 2**30
            logger.info(
                "KV cache: %d tokens (%.2f GiB) on %s", self.budget_tokens, gib, self.device
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
