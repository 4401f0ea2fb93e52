import pytest
import torch
from safetensors.torch import load_file

from vlm_models import build_model, hf_named_tensors, iter_weight_buckets, load_named_tensors


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


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def test_buckets_carry_checkpoint_names_and_shapes(tmp_path, name):
    model = build_model(name)
    model.save_pretrained(tmp_path)
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    buckets = list(iter_weight_buckets(hf_named_tensors(model), 1 << 20, model=model))
    synced = {k: v for b in buckets for k, v in b}
    assert synced.keys() == saved.keys()
    for key, tensor in saved.items():
        assert synced[key].shape == tensor.shape, key
        torch.testing.assert_close(synced[key], tensor)
    if name == "qwen3-vl-tiny":  # tied: the checkpoint has no lm_head
        assert "lm_head.weight" not in synced


def test_weights_sync_into_another_model(samples):
    torch.manual_seed(0)
    source = build_model("qwen3-vl-tiny").eval()
    torch.manual_seed(1)
    target = build_model("qwen3-vl-tiny").eval()
    count = sum(
        load_named_tensors(target, bucket)
        for bucket in iter_weight_buckets(hf_named_tensors(source), 1 << 18)
    )
    assert count == len(list(hf_named_tensors(source)))
    with torch.no_grad():
        torch.testing.assert_close(target(**samples[1]).logits, source(**samples[1]).logits)
