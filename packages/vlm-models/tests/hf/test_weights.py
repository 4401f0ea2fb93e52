import functools

import pytest
import torch
from safetensors.torch import load_file

from vlm_models.build import build_model
from vlm_models.weights import hf_named_tensors, load_named_tensors, to_checkpoint_layout
from weight_sync import iter_weight_buckets


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def test_buckets_carry_checkpoint_names_and_shapes(tmp_path, name):
    model = build_model(name)
    model.save_pretrained(tmp_path)
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    buckets = list(
        iter_weight_buckets(
            hf_named_tensors(model), 1 << 20, convert=functools.partial(to_checkpoint_layout, model)
        )
    )
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
