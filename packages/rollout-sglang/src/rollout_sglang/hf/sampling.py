"""Token sampling with the log-probabilities the trainer can recompute.

The returned log-prob is ``log_softmax(logits / T)[token]``: temperature applied, top-p/top-k
truncation *not* applied (SGLang's default too). The trainer gets the same number from its own
logits with ``rl_algos.logprobs_from_logits(logits, labels, temperature=T)``. Greedy decoding
(``T == 0``) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """``logits`` [B, V] with tokens outside the top-k / nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of ``logits`` [B, V] (float32). Returns (tokens [B], logprobs [B])."""
    if temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = logits.log_softmax(-1)
    else:
        scaled = logits if temperature == 1.0 else logits / temperature
        logprobs = scaled.log_softmax(-1)
        filtered = filter_top_k_top_p(scaled, top_k, top_p)
        # without truncation the probabilities are exp(log-probs): no second normalisation
        probs = logprobs.exp() if filtered is scaled else filtered.softmax(-1)
        # Exponential race (argmax of p / E, E ~ Exp(1)) draws from p like multinomial, but is
        # one fused pass over the vocabulary instead of a cumulative search: much faster on
        # large vocabularies on CPU, and sync-free on GPU.
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        tokens = probs.div_(noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


_MASK32 = 0xFFFFFFFF


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply rounds) on int64 tensors holding
    values below 2**32; products wrap, and the mask keeps their exact low 32 bits."""
    for mult in (0x7FEB352D, 0x846CA68B):
        h = h ^ (h >> 16)
        h = (h * mult) & _MASK32
    return h ^ (h >> 16)


def counter_uniform(seeds: Tensor, counters: Tensor) -> Tensor:
    """One uniform in (0, 1) per row, a pure function of (seed, counter) (int64 ``[B]``).

    Counter-based, so a request's draws depend only on its own seed and token index: not on
    its batch neighbours, its slot, the step it joined at, or how many draws others made. That
    makes per-request seeds reproducible under continuous batching, and it has no generator
    state, so it runs inside a captured CUDA graph.
    """
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    h = _mix32((low * 0x9E3779B1 + 0x632BE5AB) & _MASK32 ^ high)
    h = _mix32((h + counters * 0x85EBCA6B + 0x27D4EB2F) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24


def sample_with_uniform(
    logits: Tensor, uniform: Tensor, *, temperature: float, top_k: int = -1, top_p: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Like :func:`sample_tokens`, but draws by inverse CDF from one uniform per row.

    One uniform per row (not a vocabulary of noise) keeps the per-request counter scheme cheap:
    the draw is a cumulative sum and a binary search over the vocabulary. Same log-prob
    convention: ``log_softmax(logits / T)[token]``, truncation not applied.
    """
    if temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = logits.log_softmax(-1)
    else:
        scaled = logits if temperature == 1.0 else logits / temperature
        logprobs = scaled.log_softmax(-1)
        filtered = filter_top_k_top_p(scaled, top_k, top_p)
        probs = logprobs.exp() if filtered is scaled else filtered.softmax(-1)
        cdf = probs.cumsum(-1)
        target = (uniform * cdf[:, -1])[:, None]
        # right=True: the first index whose cdf exceeds the target, so zero-mass tokens
        # (flat cdf steps) are never chosen
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass(frozen=True)
class SamplingKey:
    """The sampling settings a captured graph bakes in (they shape its ops)."""

    temperature: float
    top_k: int
    top_p: float


def sample_logits(
    logits: Tensor, seeds: Tensor, counters: Tensor, sampling: SamplingKey
) -> tuple[Tensor, Tensor]:
    """Each row's token and log-prob, drawn with its (seed, counter) uniform."""
    uniform = counter_uniform(seeds, counters)
    return sample_with_uniform(
        logits,
        uniform,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
