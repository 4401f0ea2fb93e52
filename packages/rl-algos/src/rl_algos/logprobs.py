"""Token log-probabilities and entropy from logits, chunked over tokens.

``log_softmax(logits.float())`` on 8,192 tokens x 151,936 vocab is a 5 GB float32 tensor, and
autograd keeps it (and more) for the backward pass. These functions work on a chunk of rows at a
time and save only the input logits plus one or two floats per token, recomputing the softmax of
each chunk in the backward pass (custom autograd functions, gradchecked in float64). The gradient
w.r.t. the logits comes back in the logits' dtype, as plain autograd would give.

Each chunk's arithmetic is one small function per direction, run eagerly by default. With
``compiled=True`` on CUDA they run ``torch.compile``-d instead: one fused pass over a chunk rather
than about ten eager float32 passes (this is memory-bound work), on larger chunks since no float32
copy of a chunk is kept; 1.5x faster than a plain ``log_softmax`` + gather on an H200 where the
eager chunks are 0.54x (docs/performance.md). Opt-in, because compiling costs start-up time; the
FSDP actor turns them on with its compiled layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# Rows per chunk: one float32 chunk holds about this many elements (128 MiB) when eager, and
# 8x more when compiled (the compiled kernels never hold a float32 chunk).
_CHUNK_ELEMENTS = 1 << 25
_COMPILED_CHUNK_ELEMENTS = 1 << 28


def _rows_per_chunk(vocab: int, chunk_size: int | None, compiled: bool) -> int:
    if chunk_size is not None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return chunk_size
    budget = _COMPILED_CHUNK_ELEMENTS if compiled else _CHUNK_ELEMENTS
    return max(1, budget // max(vocab, 1))


def _bounds_list(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    """Python ints, with one device-to-host copy for a GPU tensor (not one per element)."""
    return cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else [int(b) for b in cu_seqlens]


def _scaled(x: Tensor, temperature: float) -> Tensor:
    """The chunk in float32 (float64 for float64 logits, for gradcheck), divided by T."""
    z = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return z / temperature if temperature != 1.0 else z


def _check_2d(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab], got shape {tuple(logits.shape)}")


# ----------------------------------------------------------------------------- chunk kernels
def _pick_fwd(x: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(log-prob of each label, log-sum-exp) of one chunk."""
    z = _scaled(x, temperature)
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(1, labels[:, None]).squeeze(1) - lse, lse


def _pick_bwd(x: Tensor, labels: Tensor, lse: Tensor, g: Tensor, temperature: float) -> Tensor:
    """d(z_label - lse)/dx = (onehot(label) - softmax(z)) / T, scaled by the upstream grad."""
    z = _scaled(x, temperature)
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]
    grad = (hit.to(z.dtype) - torch.exp(z - lse[:, None])) * g[:, None].to(z.dtype)
    return (grad / temperature if temperature != 1.0 else grad).to(x.dtype)


def _entropy_fwd(x: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(entropy H = lse - E_p[z], log-sum-exp) of one chunk."""
    z = _scaled(x, temperature)
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.exp(z - lse[:, None]) * z).sum(-1), lse


def _entropy_bwd(x: Tensor, lse: Tensor, entropy: Tensor, g: Tensor, temperature: float) -> Tensor:
    """dH/dz_k = -p_k (z_k - E_p[z]), with E_p[z] = lse - H; then / T."""
    z = _scaled(x, temperature)
    mean = (lse - entropy)[:, None]
    grad = -(z - mean) * torch.exp(z - lse[:, None]) * g[:, None].to(z.dtype)
    return (grad / temperature if temperature != 1.0 else grad).to(x.dtype)


_KERNELS: dict[str, Callable] = {
    "pick_fwd": _pick_fwd,
    "pick_bwd": _pick_bwd,
    "entropy_fwd": _entropy_fwd,
    "entropy_bwd": _entropy_bwd,
}
_compiled: dict[str, Callable] = {}
_compile_broken = False


def _use_compiled(logits: Tensor, compiled: bool) -> bool:
    return compiled and logits.is_cuda and logits.dtype != torch.float64 and not _compile_broken


def _chunk(name: str, compiled: bool, *args):
    """Kernel ``name`` on one chunk: compiled (built on first use) or eager. A compile failure
    (no triton, an unsupported build) is logged once and the process stays eager."""
    global _compile_broken
    if compiled and not _compile_broken:
        try:
            if name not in _compiled:
                _compiled[name] = torch.compile(_KERNELS[name], dynamic=True)
            return _compiled[name](*args)
        except Exception as err:
            _compile_broken = True
            logger.warning("compiled log-prob kernels unavailable (%s); running eager", err)
    return _KERNELS[name](*args)


def _map_rows(
    name: str, compiled: bool, rows: int, outs: list[Tensor], per_row: list[Tensor], *const
) -> None:
    """Run kernel ``name`` over row chunks of the ``per_row`` tensors, writing its outputs into
    the same rows of ``outs`` (preallocated, so no chunk list is ever concatenated)."""
    for start in range(0, per_row[0].shape[0], rows):
        res = _chunk(name, compiled, *(t[start : start + rows] for t in per_row), *const)
        for out, part in zip(outs, res if isinstance(res, tuple) else (res,), strict=True):
            out[start : start + rows] = part


def _row_floats(logits: Tensor) -> Tensor:
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.empty(logits.shape[0], dtype=dtype, device=logits.device)


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: Tensor, labels: Tensor, temperature: float, rows: int, compiled: bool
    ) -> Tensor:
        out, lse = _row_floats(logits), _row_floats(logits)
        _map_rows("pick_fwd", compiled, rows, [out, lse], [logits, labels], temperature)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.rows, ctx.compiled = temperature, rows, compiled
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        args = [logits, labels, lse, grad_out]
        _map_rows("pick_bwd", ctx.compiled, ctx.rows, [grad], args, ctx.temperature)
        return grad, None, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, rows: int, compiled: bool) -> Tensor:
        out, lse = _row_floats(logits), _row_floats(logits)
        _map_rows("entropy_fwd", compiled, rows, [out, lse], [logits], temperature)
        ctx.save_for_backward(logits, lse, out)
        ctx.temperature, ctx.rows, ctx.compiled = temperature, rows, compiled
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        args = [logits, lse, entropy, grad_out]
        _map_rows("entropy_bwd", ctx.compiled, ctx.rows, [grad], args, ctx.temperature)
        return grad, None, None, None


def logprobs_from_logits(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> Tensor:
    """``log_softmax(logits / temperature)[t, labels[t]]`` as float32 ``[T]``, chunked over tokens.

    Float64 logits give a float64 result (used by the gradcheck tests).

    Args:
        logits: ``[T, V]`` in any float dtype (bf16 from the trainer is fine; it is upcast
            chunk by chunk).
        labels: ``[T]`` token ids.
        temperature: the sampling temperature the rollout used, so the ratio compares like with
            like.
        chunk_size: rows per chunk; default keeps a float32 chunk near 128 MiB (eager) or
            1 GiB (compiled).
        compiled: on CUDA, run the chunk kernels ``torch.compile``-d (see the module docstring).
    """
    _check_2d(logits)
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} != ({logits.shape[0]},)")
    compiled = _use_compiled(logits, compiled)
    rows = _rows_per_chunk(logits.shape[1], chunk_size, compiled)
    return _LogProbs.apply(logits, labels.long(), float(temperature), rows, compiled)


def entropy_from_logits(
    logits: Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row, float32 ``[T]``, chunked over tokens
    (``chunk_size`` and ``compiled`` as in :func:`logprobs_from_logits`)."""
    _check_2d(logits)
    compiled = _use_compiled(logits, compiled)
    rows = _rows_per_chunk(logits.shape[1], chunk_size, compiled)
    return _Entropy.apply(logits, float(temperature), rows, compiled)


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
    compiled: bool = False,
) -> Tensor:
    """Log-probs of packed samples, aligned to ``input_ids`` (the token alignment convention).

    ``logits[t]`` is the model output at position ``t`` (it predicts token ``t + 1``). The result
    has ``out[t] = log p(input_ids[t] | input_ids[:t])`` inside each sample and ``0`` at each
    sample's first position, so it lines up with ``loss_mask`` / ``advantages`` of the packed
    batch. Float32 ``[T]``. ``compiled``: as :func:`logprobs_from_logits`.
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
    lp = logprobs_from_logits(
        logits, next_ids, temperature, chunk_size=chunk_size, compiled=compiled
    )
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


def scatter_rows(rows: Tensor, positions: Tensor, total: int) -> Tensor:
    """Per-token values ``[total]`` from the values ``rows [R]`` of the tokens at ``positions``
    (the loss tokens, when the LM head ran only on the rows predicting them); 0 elsewhere, as
    the token alignment convention allows. Differentiable through ``rows``."""
    return rows.new_zeros(total).index_copy(0, positions, rows)
