"""Token sampling with the log-probabilities the trainer can recompute.

The returned log-prob is ``log_softmax(logits / T)[token]``: temperature applied, top-p/top-k
truncation *not* applied (SGLang's default too). The trainer gets the same number from its own
logits with ``rl_algos.logprobs_from_logits(logits, labels, temperature=T)``. Greedy decoding
(``T == 0``) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

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
