"""The Triton split-KV decode attention against SDPA: the kernel alone and inside the engine.

On a GPU the kernels run compiled; without one they run on CPU tensors through Triton's
interpreter (the package conftest turns it on before triton is imported).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout_sglang.hf import decode_attention as da
from rollout_sglang.hf.engine import HFEngine, resolve_attention
from rollout_sglang.types import GenerateRequest, SamplingParams
from vlm_models.build import build_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not da.interpreted(),
    reason="no GPU and triton was imported before TRITON_INTERPRET=1 was set",
)

# (kv heads, query heads per KV head, head_dim): MHA, Qwen3-VL-2B's group 2, a group of 4 at
# head_dim 128, Qwen3.5-35B-A3B's 2 KV heads of 8 query heads at head_dim 256, Qwen3-VL-4B's and
# 8B's 8 KV heads of 4
SHAPES = [(2, 1, 32), (2, 2, 64), (2, 4, 128), (2, 8, 256), (8, 4, 128)]


def _inputs(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q as the decoder hands it (a slice of the q/k projection, so not contiguous), a cache of
    more slots than the batch and a capacity past the bucket, lengths from 0 to the bucket's
    last index. Every cell past a slot's length, and every slot past the batch, holds NaN:
    reading any of them would show in the output."""
    g = torch.Generator().manual_seed(seed)
    batch, kv_len, cap = 5, 256, 272
    heads = kv_heads * group
    qk = torch.randn(batch, heads + kv_heads, head_dim, generator=g)
    q = qk[:, :heads].reshape(batch, kv_heads, group, head_dim)
    lengths = torch.tensor([0, kv_len - 1, 130, 1, 64])  # 64: a block edge
    keys = torch.randn(batch + 2, kv_heads, cap, head_dim, generator=g)
    values = torch.randn(batch + 2, kv_heads, cap, head_dim, generator=g)
    live = torch.arange(cap)[None, :] <= lengths[:, None]  # [B, cap]
    stale = torch.ones(batch + 2, cap, dtype=torch.bool)
    stale[:batch] = ~live
    keys[stale[:, None, :, None].expand_as(keys)] = float("nan")
    values[stale[:, None, :, None].expand_as(values)] = float("nan")
    cast = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return cast(q), cast(keys), cast(values), lengths.to(DEVICE), kv_len


def _sdpa_reference(q, keys, values, lengths, kv_len, scale):
    """The decoder's SDPA path in float32, on the cache with its NaN cells zeroed (SDPA reads
    the whole bucket and relies on masked cells being finite)."""
    batch = q.shape[0]
    k = keys[:batch, :, :kv_len].float().nan_to_num(0.0)
    v = values[:batch, :, :kv_len].float().nan_to_num(0.0)
    mask = (torch.arange(kv_len, device=q.device)[None, :] <= lengths[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("splits", [None, 1, 3], ids=["policy", "one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{h}-g{g}-d{d}" for h, g, d in SHAPES])
def test_kernel_equals_sdpa(shape, dtype, splits):
    kv_heads, group, head_dim = shape
    q, keys, values, lengths, kv_len = _inputs(kv_heads, group, head_dim, dtype, seed=head_dim)
    scale = head_dim**-0.5
    out = da.decode_attention(q, keys, values, lengths, kv_len, scale, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _sdpa_reference(q, keys, values, lengths, kv_len, scale)
    if dtype == torch.float32:
        # float32 sums over <= 256 keys in another order: ~1e-6 apart
        atol = 1e-5
    else:
        # bf16 (8 significant bits): the probabilities are rounded to bf16 before the value
        # product (each term off by <= 2^-9 relative) and the output is rounded once more
        # (<= 2^-9 of |out| <= max|v|): together <= 2^-8 max|v|
        atol = 2**-8 * float(values.nan_to_num(0.0).abs().max())
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    # a slot of length 0 attends to its own token alone: its value row, exactly
    torch.testing.assert_close(out[0].float(), values[0, :, :1].float().expand_as(out[0]))


def test_split_policy_depends_on_shapes_only():
    # H200: 132 SMs. Qwen3-VL-2B's 8 KV heads at batch 256 fill the GPU without splitting;
    # Qwen3.5's 2 KV heads at batch 64 (128 programs) split the 768-key bucket
    assert da.kv_splits(256, 8, 768, sm_count=132, block=64) == (1, 768)
    splits, split_len = da.kv_splits(64, 2, 768, sm_count=132, block=32)
    assert splits > 1 and split_len % 32 == 0 and split_len >= da.MIN_SPLIT_TOKENS
    for batch in (1, 3, 64, 256):
        for kv_len in (16, 128, 768, 4096):
            n, length = da.kv_splits(batch, 2, kv_len, sm_count=132, block=64)
            # the splits cover the bucket, none of them past it, at most MAX_SPLITS
            assert (n - 1) * length < kv_len <= n * length and 1 <= n <= da.MAX_SPLITS


def test_auto_is_sdpa_off_cuda():
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attention("triton", torch.device("cpu")) == "triton"


def _text_requests() -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(0)
    return [GenerateRequest(input_ids=torch.randint(100, 5000, (n,), generator=g)) for n in (9, 23)]


@pytest.mark.parametrize("preset", ["qwen3-vl-tiny", "qwen3.5-tiny"])
@pytest.mark.parametrize("split", [False, True], ids=["policy", "split"])
def test_engine_tokens_equal_sdpa(preset, split, prompt_samples, monkeypatch):
    if split:  # the CPU buckets are short: splits of 16 keys, so the combine kernel runs too
        policy = da.kv_splits
        monkeypatch.setattr(
            da, "kv_splits", lambda b, h, n, **kw: policy(b, h, n, **{**kw, "sm_count": 10**4})
        )
        monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 16)
        monkeypatch.setattr(da, "block_n", lambda head_dim: 16)
    torch.manual_seed(0)
    model = build_model(preset, device=DEVICE).eval()
    if preset.startswith("qwen3-vl"):
        requests = [GenerateRequest.from_prompt(s) for s in prompt_samples[:3]]
    else:  # its image-token ids are not the processor's: text prompts
        requests = _text_requests()
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    triton = HFEngine(model, max_batch_size=2, decode_attention="triton", cuda_graphs=False)
    sdpa = HFEngine(model, max_batch_size=2, decode_attention="sdpa", cuda_graphs=False)
    ours, theirs = triton.generate(requests, params), sdpa.generate(requests, params)
    assert triton.decoder.attention == "triton"  # it ran, no fall-back
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        # float32 attention summed in another order; the engine's log-probs match a forward
        # pass to 1e-5 (test_hf_engine), so do both paths to each other
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("preset", ["qwen3-vl-tiny", "qwen3.5-tiny"])
def test_a_failing_kernel_falls_back_to_sdpa(preset, monkeypatch):
    # Qwen3.5's three gated-delta-net layers run before its attention layer fails: the failed
    # step is a dry run, so their recurrent states are not advanced twice
    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")  # a Triton build failure's message

    requests = _text_requests()
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    torch.manual_seed(0)
    model = build_model(preset, device=DEVICE).eval()
    engine = HFEngine(model, max_batch_size=2, decode_attention="triton")
    monkeypatch.setattr(engine.decoder, "_triton_attend", broken)
    out = engine.generate(requests, params)
    assert engine.decoder.attention == "sdpa"
    expected = HFEngine(model, max_batch_size=2, decode_attention="sdpa").generate(requests, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
