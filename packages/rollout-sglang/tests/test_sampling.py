from __future__ import annotations

import pytest
import torch

from rollout_sglang import SamplingParams
from rollout_sglang.sampling import filter_top_k_top_p, sample_tokens


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
