"""The packed attention backend: attention stays inside each sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainers_fsdp.attention import PackedSeqInfo, packed_attention_forward


class _Causal(torch.nn.Module):
    is_causal = True


def _per_sample_reference(q, k, v, lengths):
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, enable_gqa=True
            )
        )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def _inputs(device, dtype, lengths):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q = torch.randn(1, 4, t, 32, generator=g).to(device, dtype)
    k = torch.randn(1, 2, t, 32, generator=g).to(device, dtype)  # GQA: 2 KV heads
    v = torch.randn(1, 2, t, 32, generator=g).to(device, dtype)
    return q, k, v


def test_packed_attention_matches_per_sample_and_ignores_other_samples():
    lengths = [5, 9, 3]
    q, k, v = _inputs("cpu", torch.float32, lengths)
    info = PackedSeqInfo.from_lengths(lengths, torch.device("cpu"))
    out, _ = packed_attention_forward(_Causal(), q, k, v, None, packed_seq_info=info)
    assert out.shape == (1, sum(lengths), 4, 32)
    torch.testing.assert_close(out, _per_sample_reference(q, k, v, lengths))
    # changing the second sample leaves the first and third untouched
    k2 = k.clone()
    k2[:, :, 5:14] += 1.0
    out2, _ = packed_attention_forward(_Causal(), q, k2, v, None, packed_seq_info=info)
    torch.testing.assert_close(out2[:, :5], out[:, :5])
    torch.testing.assert_close(out2[:, 14:], out[:, 14:])
    assert not torch.allclose(out2[:, 5:14], out[:, 5:14])


@pytest.mark.gpu
def test_varlen_kernel_matches_per_sample_on_gpu():
    """FlashAttention's varlen op (GQA, causal within samples), forward and gradients."""
    lengths = [300, 1024, 77]
    q, k, v = (t.requires_grad_() for t in _inputs("cuda", torch.bfloat16, lengths))
    info = PackedSeqInfo.from_lengths(lengths, torch.device("cuda"))
    out, _ = packed_attention_forward(_Causal(), q, k, v, None, packed_seq_info=info)
    ref = _per_sample_reference(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_non_causal_varlen_matches_per_image_on_gpu():
    """The vision blocks' call: every image attends within itself, in both directions."""
    from trainers_fsdp.attention import flash_varlen

    lengths = [64, 256, 16]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in _inputs("cuda", torch.bfloat16, lengths))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    cu = PackedSeqInfo.from_lengths(lengths, torch.device("cuda")).cu_seqlens
    out = flash_varlen(q, k, v, cu, max(lengths), causal=False, scale=None)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        ref = F.scaled_dot_product_attention(*(t[sl].transpose(0, 1) for t in (q, k, v)))
        torch.testing.assert_close(out[sl], ref.transpose(0, 1), atol=2e-2, rtol=2e-2)
        start += n
