"""Colocation: the trainer and the transformers engine on the same GPUs, one phase at a time.

What the trainer keeps on the GPU while the engine generates (its weights and optimizer state,
its gradients where the backend keeps them), the engine's KV cache beside it in tokens, and
whether the state leaves the GPU for each rollout (:func:`plan_colocation`). The step's own
layout is chosen in :mod:`rl_runtime.memory`; here, the rollout's side of the same GPU, and
what the released engine still keeps during the step (``ENGINE_IDLE_BYTES``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rl_runtime.memory import RESERVE_BYTES, GiB, MemoryEstimate, ModelShape

__all__ = [
    "ENGINE_IDLE_BYTES",
    "ColocationPlan",
    "engine_cache",
    "keep_train_state_on_gpu",
    "plan_colocation",
]

#: What a colocated engine keeps on its GPU while the trainer steps, its weights and KV cache
#: released: the CUDA context, loaded kernels (fla, Triton, tilelang), cuBLAS workspaces. The
#: trainer's step has the GPU less this. At least 3.0 GiB on an H100 (2026-12-06, the Qwen3.5
#: cut to 4 layers on Megatron: the GPU's peak less the trainer's, 80,459 - 77,376 MiB, during
#: the train step, where the trainer ran out of memory under a plan that gave it the whole GPU).
ENGINE_IDLE_BYTES = 3 * GiB


def engine_cache(
    shape: ModelShape,
    estimate: MemoryEstimate,
    *,
    gpu_bytes: float,
    engine_sequences: int,
    engine_share: float,
    state_bytes_per_sequence: int = 0,
    cap_tokens: int = 0,
) -> tuple[float, int]:
    """Colocated beside the trainer's resident state (:attr:`MemoryEstimate.resident`): the
    bytes of the engine's cache, ``engine_share`` of what is left once both processes have
    their reserve and the engine its bf16 weights (the HF engine's ``kv_cache_fraction`` of
    free memory), and the KV tokens that holds beside ``engine_sequences`` sequences'
    recurrent states (``state_bytes_per_sequence``: Qwen3.5's gated-delta-net layers keep a
    state per sequence and no keys). At most ``cap_tokens`` (0: no cap): what the engine's
    batch slots can fill at once, the rest of the memory left free for the engine's decode
    step and whatever a colocated trainer keeps beyond its estimate (the Qwen3.5 cut's
    Megatron trainer kept 11 GiB past it on an H100, 2026-12-06, and a cache of ten times the
    rollout's need left the decode step no room)."""
    engine_weights = 2 * (shape.language_params + shape.vision_params)
    left = gpu_bytes - estimate.resident - engine_weights - 2 * RESERVE_BYTES
    got = max(0.0, engine_share * left)
    if shape.kv_bytes_per_token <= 0:
        return got, 0
    states = engine_sequences * state_bytes_per_sequence
    tokens = max(0, int((got - states) // shape.kv_bytes_per_token))
    if cap_tokens and tokens > cap_tokens:
        tokens = cap_tokens
        got = states + tokens * shape.kv_bytes_per_token
    return got, tokens


def keep_train_state_on_gpu(
    shape: ModelShape,
    estimate: MemoryEstimate,
    *,
    gpu_bytes: float,
    engine_sequences: int,
    tokens_per_sequence: int,
    engine_share: float,
    state_bytes_per_sequence: int = 0,
    engine_slots: int = 0,
) -> tuple[bool, str]:
    """Colocated: may the trainer's resident state (its weights and optimizer state, and its
    gradients where the backend keeps them between steps) stay on the GPU while the engine
    generates? Yes when the engine's cache beside it (:func:`engine_cache`) still holds
    ``engine_sequences`` sequences of ``tokens_per_sequence`` tokens: then the onload and
    offload copies of every step are waste. Returns the answer and its numbers, the cache in
    GiB and in tokens (for the log and ``--print-config``). ``engine_slots``: the engine's
    batch slots, whose sequences of ``tokens_per_sequence`` cap the cache (0: no cap)."""
    got, tokens = engine_cache(
        shape,
        estimate,
        gpu_bytes=gpu_bytes,
        engine_sequences=engine_sequences,
        engine_share=engine_share,
        state_bytes_per_sequence=state_bytes_per_sequence,
        cap_tokens=engine_slots * tokens_per_sequence,
    )
    engine_weights = 2 * (shape.language_params + shape.vision_params)
    need_tokens = engine_sequences * tokens_per_sequence
    states = engine_sequences * state_bytes_per_sequence
    kv_need = need_tokens * shape.kv_bytes_per_token + states
    keep = shape.kv_bytes_per_token > 0 and tokens >= need_tokens
    with_states = f", {states / GiB:.1f} GiB of it recurrent states" if states else ""
    capped = ""
    if engine_slots and tokens == engine_slots * tokens_per_sequence:
        capped = f", what its {engine_slots} slots fill"
    why = (
        f"trainer state {estimate.resident / GiB:.1f} GiB, engine weights "
        f"{engine_weights / GiB:.1f}, its KV cache {got / GiB:.1f} GiB ({tokens:,} tokens"
        f"{capped}) "
        f"beside them for {kv_need / GiB:.1f} needed ({engine_sequences} x "
        f"{tokens_per_sequence} = {need_tokens:,} tokens{with_states}), of "
        f"{gpu_bytes / GiB:.1f} GiB"
    )
    return keep, why


@dataclass(frozen=True)
class ColocationPlan:
    """Where a colocated trainer's state sits while the engine generates: ``optimizer_offload``,
    the part of the optimizer state stepped on the host (the layout's, or more), and
    ``offload_train``, whether the rest leaves the GPU for each rollout; ``why`` for the log.
    ``kv_cache_tokens``: the tokens the plan gives the engine's KV cache beside what the
    trainer keeps (the transformers engine's ``cache_tokens``; None: no plan for it)."""

    optimizer_offload: float
    offload_train: bool
    why: str
    kv_cache_tokens: int | None = None


def plan_colocation(
    shape: ModelShape,
    estimate_at: Callable[[float], MemoryEstimate],
    *,
    current: float,
    fractions: Sequence[float],
    gpu_bytes: float,
    host_bytes: float | None,
    engine_sequences: int,
    tokens_per_sequence: int,
    engine_share: float,
    state_bytes_per_sequence: int = 0,
    engine_slots: int = 0,
) -> ColocationPlan:
    """The trainer's state during rollout, colocated with the transformers engine.

    It stays on the GPU where the engine's KV cache holds a rollout beside it
    (:func:`keep_train_state_on_gpu`). Otherwise it is offloaded, when its pinned host copies
    (what the trainer keeps between steps, :attr:`MemoryEstimate.resident`) fit the host
    beside the optimizer state already there (``host_bytes`` per rank). When they do not (a
    model whose optimizer the layout already put partly on the host: the 8B on one H200 with
    128 GiB of host memory), the state stays on the GPU and more of the optimizer moves to the
    host, the first of ``fractions`` above ``current`` that lets the cache hold a rollout, else
    the largest that fits the host: a smaller cache runs the rollout's sequences in turns,
    slower but within memory. ``estimate_at(f)``: the layout's estimate with ``f`` of the
    optimizer on the host; ``fractions``: the ones the user left free (none when given). The
    plan's ``kv_cache_tokens`` are the cache's tokens beside the state where it stays, beside
    nothing of the trainer's where it is offloaded, at most what the engine's ``engine_slots``
    fill (:func:`engine_cache`)."""

    def beside(estimate: MemoryEstimate) -> tuple[bool, str]:
        return keep_train_state_on_gpu(
            shape,
            estimate,
            gpu_bytes=gpu_bytes,
            engine_sequences=engine_sequences,
            tokens_per_sequence=tokens_per_sequence,
            engine_share=engine_share,
            state_bytes_per_sequence=state_bytes_per_sequence,
            engine_slots=engine_slots,
        )

    def tokens(estimate: MemoryEstimate) -> int | None:
        _, kv = engine_cache(
            shape,
            estimate,
            gpu_bytes=gpu_bytes,
            engine_sequences=engine_sequences,
            engine_share=engine_share,
            state_bytes_per_sequence=state_bytes_per_sequence,
            cap_tokens=engine_slots * tokens_per_sequence,
        )
        return kv or None

    estimate = estimate_at(current)
    keep, why = beside(estimate)
    if keep:
        return ColocationPlan(current, False, why, tokens(estimate))
    copies = estimate.host + estimate.resident
    if host_bytes is None or copies <= host_bytes:
        offloaded = dataclasses.replace(estimate, kept=0.0)
        return ColocationPlan(current, True, why, tokens(offloaded))
    short = (
        f"offloading it would take {copies / GiB:.1f} GiB of host memory per rank of "
        f"{host_bytes / GiB:.1f} (--host-memory-gib)"
    )
    best = current
    for f in sorted(x for x in fractions if x > current):
        option = estimate_at(f)
        # (a layout whose backend keeps the optimizer on the GPU whatever the fraction, as
        # sharded FSDP does, gains nothing: its host part does not grow)
        # (its train step has the GPU less what the released engine keeps)
        fits = option.fits(gpu_bytes - ENGINE_IDLE_BYTES, host_bytes)
        if option.host <= estimate.host or not fits:
            continue
        best = f
        keep, why = beside(option)
        if keep:
            return ColocationPlan(
                f, False, f"{short}; optimizer {f:.0%} on the host: {why}", tokens(option)
            )
    chosen = estimate_at(best)
    _, why = beside(chosen)
    return ColocationPlan(
        best,
        False,
        f"{short}; kept on the GPU with the optimizer {best:.0%} on the host, the engine's KV "
        f"cache runs the rollout's sequences in turns: {why}",
        tokens(chosen),
    )
