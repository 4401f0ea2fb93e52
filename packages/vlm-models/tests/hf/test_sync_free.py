import copy

import pytest
import torch

from vlm_models import build_model, remove_host_syncs


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ref = build_model("qwen3-vl-tiny").train()
    ours = copy.deepcopy(ref)
    return ref, ours, remove_host_syncs(ours)


def _inputs(sample) -> dict:
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    return {k: sample[k] for k in keys if k in sample}


@pytest.mark.parametrize("which", [0, 2], ids=["one image", "two images"])
def test_forward_and_gradients_equal_transformers(models, samples, which):
    ref, ours, replaced = models
    assert replaced == ["_deepstack_process", "get_placeholder_mask"]
    inputs = _inputs(samples[which])
    outs = []
    for model in (ref, ours):
        model.zero_grad()
        logits = model(**inputs).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
        (logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((logits.detach(), grads))
    (ref_logits, ref_grads), (our_logits, our_grads) = outs
    torch.testing.assert_close(our_logits, ref_logits, rtol=0, atol=0)
    assert our_grads.keys() == ref_grads.keys()
    # the deepstack mergers' gradients pass only through the replaced merge
    assert any("deepstack" in n and g.abs().sum() > 0 for n, g in our_grads.items())
    for name, grad in ref_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=0, atol=0, msg=name)


def test_text_only_model_is_left_alone():
    class Plain(torch.nn.Module):
        pass

    assert remove_host_syncs(Plain()) == []
