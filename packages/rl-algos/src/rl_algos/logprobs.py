"""Token log-probabilities and entropy from logits, chunked over tokens.

``log_softmax(logits.float())`` on 8,192 tokens x 151,936 vocab is a 5 GB float32 tensor, and
autograd keeps it (and more) for the backward pass. These functions work on ``chunk_size`` rows
at a time in float32 and save only the input logits plus one float per token, recomputing the
softmax of each chunk in the backward pass (custom autograd functions, gradchecked in float64).
The gradient w.r.t. the logits comes back in the logits' dtype, as plain autograd would give.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Rows per chunk are chosen so that one float32 chunk holds about this many elements (128 MiB).
_CHUNK_ELEMENTS = 1 << 25


def _rows_per_chunk(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return chunk_size
    return max(1, _CHUNK_ELEMENTS // max(vocab, 1))


def _bounds_list(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    """Python ints, with one device-to-host copy for a GPU tensor (not one per element)."""
    return cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else [int(b) for b in cu_seqlens]


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32, or float64 for float64 logits (so gradcheck sees full precision)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_2d(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab], got shape {tuple(logits.shape)}")


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, rows: int) -> Tensor:
        cdt = _compute_dtype(logits)
        out = torch.empty(logits.shape[0], dtype=cdt, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows):
            x = logits[start : start + rows].to(cdt)
            if temperature != 1.0:
                x = x / temperature
            chunk_lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, labels[start : start + rows, None]).squeeze(1)
            lse[start : start + rows] = chunk_lse
            out[start : start + rows] = picked - chunk_lse
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        ctx.rows = rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        cdt = _compute_dtype(logits)
        grad_out = grad_out.to(cdt)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            x = logits[start:end].to(cdt, copy=True)
            if t != 1.0:
                x.div_(t)
            # d(x_label - lse)/dx = onehot(label) - softmax(x); scaled by the upstream grad.
            p = x.sub_(lse[start:end, None]).exp_()
            g = grad_out[start:end, None]
            p.mul_(-g)
            p.scatter_add_(1, labels[start:end, None], g)
            if t != 1.0:
                p.div_(t)
            grad[start:end] = p
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, rows: int) -> Tensor:
        cdt = _compute_dtype(logits)
        out = torch.empty(logits.shape[0], dtype=cdt, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows):
            x = logits[start : start + rows].to(cdt)
            if temperature != 1.0:
                x = x / temperature
            chunk_lse = torch.logsumexp(x, dim=-1)
            p = torch.exp(x - chunk_lse[:, None])
            # H = lse - E_p[x]
            out[start : start + rows] = chunk_lse - (p * x).sum(-1)
            lse[start : start + rows] = chunk_lse
        ctx.save_for_backward(logits, lse, out)
        ctx.temperature = temperature
        ctx.rows = rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, entropy = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        cdt = _compute_dtype(logits)
        grad_out = grad_out.to(cdt)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            x = logits[start:end].to(cdt, copy=True)
            if t != 1.0:
                x.div_(t)
            # dH/dx_k = -p_k (x_k - E_p[x]) and E_p[x] = lse - H.
            mean_x = lse[start:end] - entropy[start:end]
            p = torch.exp(x - lse[start:end, None])
            g = x.sub_(mean_x[:, None]).mul_(p).mul_(-grad_out[start:end, None])
            if t != 1.0:
                g.div_(t)
            grad[start:end] = g
        return grad, None, None


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> Tensor:
    """``log_softmax(logits / temperature)[t, labels[t]]`` as float32 ``[T]``, chunked over tokens.

    Float64 logits give a float64 result (used by the gradcheck tests).

    Args:
        logits: ``[T, V]`` in any float dtype (bf16 from the trainer is fine; it is upcast
            chunk by chunk).
        labels: ``[T]`` token ids.
        temperature: the sampling temperature the rollout used, so the ratio compares like with
            like.
        chunk_size: rows per chunk; default keeps a float32 chunk near 128 MiB.
    """
    _check_2d(logits)
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} != ({logits.shape[0]},)")
    rows = _rows_per_chunk(logits.shape[1], chunk_size)
    return _LogProbs.apply(logits, labels.long(), float(temperature), rows)


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row, float32 ``[T]``, chunked over tokens."""
    _check_2d(logits)
    rows = _rows_per_chunk(logits.shape[1], chunk_size)
    return _Entropy.apply(logits, float(temperature), rows)


def first_positions_mask(cu_seqlens: Tensor | Sequence[int], total: int, device=None) -> Tensor:
    """Bool ``[T]``: True at the first token of every packed sample."""
    starts = torch.as_tensor(_bounds_list(cu_seqlens)[:-1], dtype=torch.long, device=device)
    mask = torch.zeros(total, dtype=torch.bool, device=device)
    mask[starts[starts < total]] = True
    return mask


def aligned_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """Log-probs of packed samples, aligned to ``input_ids`` (the token alignment convention).

    ``logits[t]`` is the model output at position ``t`` (it predicts token ``t + 1``). The result
    has ``out[t] = log p(input_ids[t] | input_ids[:t])`` inside each sample and ``0`` at each
    sample's first position, so it lines up with ``loss_mask`` / ``advantages`` of the packed
    batch. Float32 ``[T]``.
    """
    _check_2d(logits)
    total = input_ids.shape[0]
    if logits.shape[0] != total:
        raise ValueError(f"logits have {logits.shape[0]} rows, input_ids {total}")
    bounds = _bounds_list(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total}, got {bounds[0]}..{bounds[-1]}")
    # Row t scores input_ids[t + 1]; the last row of each sample scores the next sample's first
    # token, a value that lands on that sample's first position and is zeroed below.
    next_ids = torch.roll(input_ids, -1)
    lp = logprobs_from_logits(logits, next_ids, temperature, chunk_size=chunk_size)
    shifted = torch.cat([lp.new_zeros(1), lp[:-1]])
    first = first_positions_mask(bounds, total, device=lp.device)
    return shifted.masked_fill(first, 0.0)


def aligned_entropy(
    logits: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """Entropy of the distribution that predicted token ``t``, at position ``t`` (packed samples).

    The same layout as :func:`aligned_logprobs`: ``out[t] = H(softmax(logits[t - 1] / T))``
    inside each sample, ``0`` at each sample's first position. Float32 ``[T]``.
    """
    _check_2d(logits)
    total = logits.shape[0]
    bounds = _bounds_list(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total}, got {bounds[0]}..{bounds[-1]}")
    ent = entropy_from_logits(logits, temperature, chunk_size=chunk_size)
    shifted = torch.cat([ent.new_zeros(1), ent[:-1]])
    return shifted.masked_fill(first_positions_mask(bounds, total, device=ent.device), 0.0)
