"""The bucketer every trainer feeds its transport through: budget, order, laziness, convert."""

import pytest
import torch

from weight_sync import iter_weight_buckets


def _named(sizes):
    return [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_buckets_stay_within_budget_in_order():
    named = _named([10, 20, 5, 40, 1, 1, 30])  # float32: 4 bytes per element
    buckets = list(iter_weight_buckets(named, bucket_bytes=100))
    assert [name for b in buckets for name, _ in b] == [name for name, _ in named]
    for bucket in buckets:
        size = sum(t.numel() * 4 for _, t in bucket)
        assert size <= 100 or len(bucket) == 1
    assert [len(b) for b in buckets] == [1, 2, 1, 2, 1]  # 40*4=160 > budget: alone


def test_buckets_consume_lazily():
    seen = []

    def gen():
        for name, t in _named([25] * 6):
            seen.append(name)
            yield name, t

    first = next(iter_weight_buckets(gen(), bucket_bytes=200))
    assert [n for n, _ in first] == ["w0", "w1"]
    assert len(seen) == 3  # read one past the bucket to know it was full, no more


def test_bad_budget():
    with pytest.raises(ValueError, match="positive"):
        next(iter_weight_buckets(_named([1]), 0))


def test_convert_rewrites_each_bucket():
    """``convert`` sees each bucket as a dict (the checkpoint-layout hook) and its answer is
    what is yielded, in its order."""
    calls = []

    def convert(bucket):
        calls.append(list(bucket))
        return {f"ckpt.{k}": v * 2 for k, v in bucket.items()}

    named = [(f"w{i}", torch.full((2,), float(i))) for i in range(3)]
    buckets = list(iter_weight_buckets(named, bucket_bytes=16, convert=convert))
    assert calls == [["w0", "w1"], ["w2"]]
    assert [[n for n, _ in b] for b in buckets] == [["ckpt.w0", "ckpt.w1"], ["ckpt.w2"]]
    torch.testing.assert_close(buckets[1][0][1], torch.full((2,), 4.0))
