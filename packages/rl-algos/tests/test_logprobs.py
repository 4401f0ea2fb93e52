"""Chunked log-probs / entropy: hand values, parity with log_softmax, gradcheck, memory, alignment."""

import itertools
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rl_algos import aligned_entropy, aligned_logprobs, entropy_from_logits, logprobs_from_logits


def _reference_logprobs(logits, labels, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(1, labels[:, None])[:, 0]


def _reference_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def test_hand_values():
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])  # p = (1/4, 3/4) and (1/2, 1/2)
    lp = logprobs_from_logits(logits, torch.tensor([1, 0]))
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75), math.log(0.5)]))
    ent = entropy_from_logits(logits)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([h, math.log(2.0)]))
    # temperature 2 on doubled logits is the same distribution
    torch.testing.assert_close(logprobs_from_logits(2 * logits, torch.tensor([1, 0]), 2.0), lp)
    torch.testing.assert_close(entropy_from_logits(2 * logits, 2.0), ent)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_gather_bf16(chunk_size, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(50, 97)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 97, (50,))
    weights = torch.randn(50)

    ours = logprobs_from_logits(logits, labels, temperature, chunk_size=chunk_size)
    assert ours.dtype == torch.float32
    (ours * weights).sum().backward()
    grad_ours, logits.grad = logits.grad, None
    ref = _reference_logprobs(logits, labels, temperature)
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert grad_ours.dtype == torch.bfloat16
    torch.testing.assert_close(grad_ours, logits.grad, atol=1e-2, rtol=1e-2)

    logits.grad = None
    ent = entropy_from_logits(logits, temperature, chunk_size=chunk_size)
    (ent * weights).sum().backward()
    grad_ours, logits.grad = logits.grad, None
    ref = _reference_entropy(logits, temperature)
    (ref * weights).sum().backward()
    torch.testing.assert_close(ent, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad_ours, logits.grad, atol=1e-2, rtol=1e-2)


def test_float32_input_not_modified():
    logits = torch.randn(9, 13, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, 13, (9,))
    (
        logprobs_from_logits(logits, labels, 0.5, chunk_size=4).sum()
        + entropy_from_logits(logits, 0.5, chunk_size=4).sum()
    ).backward()
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_float64(temperature):
    torch.manual_seed(1)
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (6,))
    assert torch.autograd.gradcheck(
        lambda x: logprobs_from_logits(x, labels, temperature, chunk_size=4), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda x: entropy_from_logits(x, temperature, chunk_size=4), (logits,)
    )
    cu = torch.tensor([0, 2, 6])
    ids = torch.randint(0, 5, (6,))
    assert torch.autograd.gradcheck(
        lambda x: aligned_logprobs(x, ids, cu, temperature, chunk_size=3), (logits,)
    )


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_no_full_float32_copy():
    """No single op allocates a float32 [T, V] tensor; the plain baseline does (so this can fail)."""
    tokens, vocab = 256, 4096
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    full_f32 = tokens * vocab * 4

    def ours():
        logprobs_from_logits(logits, labels, chunk_size=32).sum().backward()
        entropy_from_logits(logits, chunk_size=32).sum().backward()

    def baseline():
        _reference_logprobs(logits, labels).sum().backward()

    assert _largest_allocation(ours) < full_f32
    assert _largest_allocation(baseline) >= full_f32


def test_aligned_logprobs_hand_values():
    # Uniform logits over 2 tokens: every scored position is log(1/2); firsts are 0.
    logits = torch.zeros(5, 2)
    ids = torch.tensor([0, 1, 1, 0, 1])
    out = aligned_logprobs(logits, ids, torch.tensor([0, 3, 5]))
    h = math.log(0.5)
    torch.testing.assert_close(out, torch.tensor([0.0, h, h, 0.0, h]))


def test_aligned_logprobs_matches_per_sample_loop():
    torch.manual_seed(2)
    lengths = [4, 1, 6]
    total, vocab = sum(lengths), 11
    logits = torch.randn(total, vocab)
    ids = torch.randint(0, vocab, (total,))
    cu = [0, 4, 5, 11]
    out = aligned_logprobs(logits, ids, cu, 0.8, chunk_size=2)
    expected = torch.zeros(total)
    for start, end in itertools.pairwise(cu):
        for t in range(start + 1, end):
            expected[t] = torch.log_softmax(logits[t - 1] / 0.8, -1)[ids[t]]
    torch.testing.assert_close(out, expected)


def test_bad_shapes():
    with pytest.raises(ValueError, match="tokens, vocab"):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens"):
        aligned_logprobs(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), [0, 3])


def test_aligned_entropy_hand_values():
    logits = torch.tensor([[0.0, 0.0], [0.0, 100.0], [0.0, 0.0], [0.0, 0.0]])
    out = aligned_entropy(logits, [0, 3, 4])
    # position 1 <- row 0 (uniform: ln 2), position 2 <- row 1 (near one-hot: ~0), firsts 0
    torch.testing.assert_close(out, torch.tensor([0.0, math.log(2.0), 0.0, 0.0]), atol=1e-6, rtol=0)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: aligned_entropy(a, [0, 2, 5], 0.9), (x,))


@pytest.mark.gpu
def test_cuda_parity_and_peak_memory():
    """On CUDA: same values and gradients as the baseline, well under its peak memory."""
    tokens, vocab = 2048, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen, device="cuda", dtype=torch.bfloat16)
    logits.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
    weights = torch.randn(tokens, generator=gen, device="cuda")

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        (out * weights).sum().backward()
        torch.cuda.synchronize()
        grad, logits.grad = logits.grad, None
        return out.detach(), grad, torch.cuda.max_memory_allocated() - base

    ours, g_ours, m_ours = peak(lambda: logprobs_from_logits(logits, labels, chunk_size=128))
    ref, g_ref, m_ref = peak(lambda: _reference_logprobs(logits, labels))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-2, rtol=1e-2)
    full_f32 = tokens * vocab * 4
    assert m_ours < full_f32 < m_ref


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_compiled_kernels_match_float64(temperature):
    """The compiled CUDA chunk kernels (``compiled=True``): log-probs, entropy and both gradients
    against float64."""
    tokens, vocab = 1000, 50000
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(tokens, vocab, generator=gen, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
    weights = torch.randn(tokens, generator=gen, device="cuda")

    def run(fn, x):
        x = x.detach().requires_grad_()
        out = fn(x)
        (out * weights.to(out.dtype)).sum().backward()
        return out.double(), x.grad.double()

    x64 = logits.double()
    for ours_fn, ref_fn in (
        (
            lambda x: logprobs_from_logits(x, labels, temperature, chunk_size=384, compiled=True),
            lambda x: torch.log_softmax(x / temperature, -1).gather(1, labels[:, None])[:, 0],
        ),
        (
            lambda x: entropy_from_logits(x, temperature, chunk_size=384, compiled=True),
            lambda x: (
                -(torch.softmax(x / temperature, -1) * torch.log_softmax(x / temperature, -1)).sum(
                    -1
                )
            ),
        ),
    ):
        ours, g_ours = run(ours_fn, logits)
        ref, g_ref = run(ref_fn, x64)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(g_ours, g_ref, atol=1e-3, rtol=2e-2)
