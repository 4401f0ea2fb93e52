from __future__ import annotations

import pytest
import torch

from rollout_sglang.hf.sampling import (
    counter_uniform,
    filter_top_k_top_p,
    sample_tokens,
    sample_with_uniform,
)
from rollout_sglang.types import SamplingParams


def test_top_k_keeps_k_best():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    kept = filter_top_k_top_p(logits, top_k=2, top_p=1.0).isfinite()
    assert kept.tolist() == [[False, True, False, True]]


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_top_k_top_p(probs.log(), top_k=-1, top_p=0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    assert filter_top_k_top_p(probs.log(), -1, 0.1).isfinite().sum() == 1  # top token stays


def test_sampling_follows_the_distribution_and_reports_tempered_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_tokens(logits, temperature=2.0, generator=g)
    expected = (logits[0] / 2.0).softmax(-1)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_greedy():
    tokens, logprobs = sample_tokens(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0.0)
    assert tokens.tolist() == [1]
    assert logprobs.item() == pytest.approx(torch.tensor([0.0, 5.0, 1.0]).log_softmax(-1)[1].item())


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"max_new_tokens": 0}])
def test_sampling_params_validated(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_counter_uniform_is_a_pure_function_of_seed_and_counter():
    seeds = torch.arange(50000, dtype=torch.long) * 7919 + (1 << 40)
    counters = torch.arange(50000, dtype=torch.long) % 13
    u = counter_uniform(seeds, counters)
    assert torch.equal(u, counter_uniform(seeds.clone(), counters.clone()))
    assert torch.equal(u[10:20], counter_uniform(seeds[10:20], counters[10:20]))  # no batch state
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # the next counter (the next token of the same request) draws something else
    assert (counter_uniform(seeds, counters + 1) != u).float().mean() > 0.99


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]]).repeat(20000, 1)
    u = counter_uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    tokens, logprobs = sample_with_uniform(logits, u, temperature=2.0)
    expected = (logits[0] / 2.0).softmax(-1)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])
    kept, _ = sample_with_uniform(logits, u, temperature=1.0, top_k=1)
    assert kept.eq(2).all()
