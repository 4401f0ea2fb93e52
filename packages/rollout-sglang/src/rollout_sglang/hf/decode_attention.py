"""Split-KV ("flash-decoding") grouped-query attention for one decode token, in Triton.

Why: the SDPA path reads ``keys[:B, :, :kv_len]`` for every slot, ``kv_len`` being the longest
live length of the batch rounded up, and builds a boolean mask over it; at rollout batch sizes
the step then moves several times the bytes the live tokens hold. This kernel streams each
slot's keys and values only up to that slot's own length, read from the ``lengths`` tensor on
the device, so a step needs no host read and stays capturable as a CUDA graph.

How: one program per (slot, KV head, split of the KV length). It loads the ``group`` query
heads of its KV head once (as the rows of one small matrix, padded to 16 for ``tl.dot``),
streams its split in blocks of ``BLOCK_N`` keys, keeps a running max and sum in float32
(online softmax, base 2), and writes its normalised partial output and log-sum-exp. A split
that starts past the slot's length loads nothing and writes an empty result (weight 0). A
second small kernel combines the splits of each query head. With one split the first kernel
writes the output itself. The number of splits is a host function of the shapes only (batch,
KV heads, the KV-length bucket, the GPU's SM count), so each captured graph has a fixed grid.

Numerics: scores and the softmax in float32; the probabilities are cast to the value dtype
before the second product (as flash attention does), so bf16 results differ from a float32
reference by bf16 rounding; float32 inputs use IEEE float32 products (no TF32).

Under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported) the same
kernels run on CPU tensors (slowly; for tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # torch's Linux wheels ship triton; elsewhere install it
    raise ImportError(
        "decode_attention needs triton (`uv pip install triton`, shipped with torch's Linux "
        "CUDA wheels); decode with attention='sdpa' without it"
    ) from exc

_LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 128  # a split shorter than this costs more in partials than it balances
MAX_SPLITS = 16


@triton.jit
def _split_kernel(
    Q,
    K,
    V,
    Lengths,
    Out,
    PartOut,
    PartLse,
    stride_qb,
    stride_qh,
    stride_qg,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    scale_log2,
    split_len,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kv_heads = tl.num_programs(1)
    live = tl.load(Lengths + b).to(tl.int32) + 1  # keys 0..length, this token's included
    start = s * split_len
    end = tl.minimum(start + split_len, live)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q_ptr = Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :]
    q = tl.load(q_ptr, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: the same products, in float32
        q = q.to(tl.float32)
    slot = b.to(tl.int64)  # a cache layer can pass 2^31 elements (long contexts)
    k_base = K + slot * stride_kb + h * stride_kh + offs_d[None, :]
    v_base = V + slot * stride_vb + h * stride_vh + offs_d[None, :]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        n_ok = offs < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs[:, None] * stride_kn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs[:, None] * stride_vn, mask=kv_mask, other=0.0)
        p = p.to(V.dtype.element_ty)  # as flash attention: probabilities in the value dtype
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    rows = (b * kv_heads + h) * GROUP + offs_g  # query heads in [B, kv_heads, group] order
    out_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_sum[:, None]
        o_ptr = Out + rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        empty = l_sum == 0.0  # the split starts past this slot's length
        safe = tl.where(empty, 1.0, l_sum)
        out = acc / safe[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.log2(safe))
        p_ptr = PartOut + (rows[:, None] * NUM_SPLITS + s) * HEAD_DIM + offs_d[None, :]
        tl.store(p_ptr, out, mask=out_mask)
        tl.store(PartLse + rows * NUM_SPLITS + s, lse, mask=g_ok)


@triton.jit
def _combine_kernel(
    PartOut,
    PartLse,
    Out,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # one query head of one slot
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(PartLse + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    p_ptr = PartOut + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    parts = tl.load(p_ptr, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + row * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def block_n(head_dim: int) -> int:
    """Keys per block: 64 (32 for head_dim > 128, whose K and V tiles are twice the size)."""
    return 64 if head_dim <= 128 else 32


def kv_splits(
    batch: int, kv_heads: int, kv_len: int, *, sm_count: int, block: int
) -> tuple[int, int]:
    """(number of splits, keys per split) for a step's shapes: enough programs for about two
    per SM, no split under ``MIN_SPLIT_TOKENS`` keys, at most ``MAX_SPLITS``; the split length a
    multiple of ``block``. Shapes only, never the lengths: one grid per captured graph.

    Two, not four: on the H200 (132 SMs, 2026-12-04, ``bench_decode_attention.py``) the best of
    1/2/4/8 forced splits was 1 at 512 (slot, KV head) programs (2B batch 64: 44.9 against 49.5
    us at 2 splits; Qwen3.5 batch 256: 87.6 against 97.9 at 2), 2 at 256 (Qwen3.5 batch 128:
    52.0 against 58.3 at 3) and 4 at 128 (30.2 against 32.8 at 5)."""
    want = _cdiv(2 * sm_count, max(batch * kv_heads, 1))
    return _split(kv_len, max(1, min(want, kv_len // MIN_SPLIT_TOKENS, MAX_SPLITS)), block)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(kv_len: int, splits: int, block: int) -> tuple[int, int]:
    """``splits`` or fewer splits of a multiple of ``block`` keys covering ``kv_len``."""
    split_len = _cdiv(_cdiv(kv_len, splits), block) * block
    return _cdiv(kv_len, split_len), split_len


def interpreted() -> bool:
    """True when Triton's interpreter runs these kernels (``TRITON_INTERPRET=1`` was set before
    triton was first imported): then they take CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_split_kernel, InterpretedFunction)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    lengths: Tensor,
    kv_len: int,
    scale: float,
    *,
    num_splits: int | None = None,
    block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """One query token per slot over that slot's cached keys ``0..lengths[b]``.

    ``q`` [B, kv_heads, group, D] (the query heads of each KV head; any strides with the last
    dim contiguous); ``keys``/``values`` [>= B, kv_heads, seq_cap, D] (the cache layer, last
    dim contiguous; only slots ``0..B-1`` are read); ``lengths`` [B] integer on q's device;
    ``kv_len`` a bound on every ``lengths[b] + 1`` (the step's KV bucket: it sizes the splits,
    nothing is read past a slot's own length). ``num_splits`` overrides the split count
    (:func:`kv_splits`; the bench sweeps it). Returns [B, kv_heads, group, D] in q's dtype.
    """
    batch, kv_heads, group, head_dim = q.shape
    if q.device.type != "cuda" and not interpreted():
        raise RuntimeError(
            "decode_attention on CPU tensors runs only under Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported)"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("decode_attention: keys and values need a contiguous last dim")
    block = block or block_n(head_dim)
    if num_splits is None:
        splits, split_len = kv_splits(
            batch, kv_heads, kv_len, sm_count=_sm_count(q.device), block=block
        )
    else:
        splits, split_len = _split(kv_len, num_splits, block)
    out = torch.empty((batch, kv_heads, group, head_dim), dtype=q.dtype, device=q.device)
    rows = batch * kv_heads * group
    if splits > 1:
        part_out = torch.empty((rows, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, splits), dtype=torch.float32, device=q.device)
    else:  # unused: the kernel writes ``out`` itself
        part_out = part_lse = out
    block_d = _pow2(head_dim)
    _split_kernel[(batch, kv_heads, splits)](
        q,
        keys,
        values,
        lengths,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        scale * _LOG2E,
        split_len,
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        BLOCK_G=_pow2(group),
        BLOCK_D=block_d,
        BLOCK_N=block,
        UPCAST=q.device.type != "cuda",
        # float32 products in float32 (not TF32); bf16/fp16 operands ignore it
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _combine_kernel[(rows,)](
            part_out,
            part_lse,
            out,
            HEAD_DIM=head_dim,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
            num_warps=4 if head_dim > 128 else 2,
        )
    return out
