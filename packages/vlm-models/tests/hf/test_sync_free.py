import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vlm_models.build import build_model
from vlm_models.classes import Swap, select_classes
from vlm_models.sync_free import (
    HostSyncRecorder,
    PlaceholderMask,
    SyncFreeDeepstack,
    SyncFreePlaceholderMask,
)


@pytest.fixture(scope="module", params=["qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny"])
def models(request, qwen3_vl_ids):
    torch.manual_seed(0)
    overrides = qwen3_vl_ids if request.param.startswith("qwen3.5") else {}
    ref = build_model(request.param, **overrides).train()
    ours = copy.deepcopy(ref)
    return ref, ours, select_classes(ours, sync_free=True)["sync_free"]


def _inputs(sample) -> dict:
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    return {k: sample[k] for k in keys if k in sample}


@pytest.mark.parametrize("which", [0, 2], ids=["one image", "two images"])
def test_forward_and_gradients_equal_transformers(models, samples, which):
    ref, ours, converted = models
    deepstack = hasattr(type(ref.model.language_model), "_deepstack_process")  # not Qwen3.5
    assert converted == 1 + deepstack  # the inner model, and the text model where DeepStack
    assert isinstance(ours.model, SyncFreePlaceholderMask)
    assert isinstance(ours.model.language_model, SyncFreeDeepstack) == deepstack
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
    if deepstack:  # the deepstack mergers' gradients pass only through the replaced merge
        assert any("deepstack" in n and g.abs().sum() > 0 for n, g in our_grads.items())
    for name, grad in ref_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=0, atol=0, msg=name)


def test_text_only_model_is_left_alone():
    class Plain(torch.nn.Module):
        pass

    assert select_classes(Plain(), sync_free=True)["sync_free"] == 0


def test_replaced_methods_read_nothing_from_the_device(models):
    """transformers' originals index by a boolean mask and read the placeholder count (host
    syncs on CUDA); the replacements dispatch no op whose size depends on the data."""
    ref, _, _ = models
    text, inner = ref.model.language_model, ref.model
    dim = ref.config.text_config.hidden_size
    hidden = torch.randn(1, 10, dim)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 2:6] = True
    visual = torch.randn(4, dim)
    image = ref.config.image_token_id
    ids = torch.tensor([[1, image, image, 3]])
    embeds, features = torch.randn(1, 4, dim), torch.randn(2, dim)
    calls = {
        "placeholder": (
            type(inner).get_placeholder_mask,
            SyncFreePlaceholderMask.get_placeholder_mask,
            (inner, ids, embeds, features),
        ),
    }
    if hasattr(type(text), "_deepstack_process"):  # Qwen3.5 has no DeepStack
        calls["deepstack"] = (
            type(text)._deepstack_process,
            SyncFreeDeepstack._deepstack_process,
            (text, hidden, mask, visual),
        )
    for name, (original, ours, args) in calls.items():
        with HostSyncRecorder() as seen:
            expected = original(*args)
        assert seen.found, name  # the check can fail: the originals do read the device
        with HostSyncRecorder() as seen:
            got = ours(*args)
        assert seen.found == [], name
        for a, b in zip(tree_leaves(got), tree_leaves(expected), strict=True):
            assert torch.equal(a, b), name


def test_a_changed_method_is_left_alone():
    """A transformers version whose method takes other arguments keeps its own."""

    class Inner(torch.nn.Module):
        def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None):
            return "theirs"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    class OurInner(SyncFreePlaceholderMask, Inner):
        pass

    model = Model()
    table = [Swap("sync_free", Inner, OurInner)]
    assert select_classes(model, table=table, sync_free=True)["sync_free"] == 0
    assert type(model.model) is Inner
    assert model.model.get_placeholder_mask(None, None) == "theirs"


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


def test_features_merge_without_masked_scatter(models, samples):
    """The patched forward merges image features by index: no ``masked_scatter``, whose
    backward selects by the mask (a ``nonzero`` half-way through the backward on a GPU)."""
    ref, ours, _ = models
    inputs = _inputs(samples[2])
    for model, expected in ((ref, True), (ours, False)):
        with _OpNames() as seen:
            model(**inputs).logits.sum().backward()
        assert any(n.startswith("masked_scatter") for n in seen.names) == expected


def test_placeholder_mask_scatters_by_index():
    """``masked_scatter`` by a PlaceholderMask: the same values and gradients as by the plain
    mask, no host read; other ops on it give plain tensors."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, 6, 1, dtype=torch.bool)
    mask[0, 1:3] = mask[1, 4] = True
    results = []
    for wrap in (False, True):
        embeds = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        features = torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
        m = PlaceholderMask.of(mask, 3) if wrap else mask
        with HostSyncRecorder() as seen:
            out = embeds.masked_scatter(m, features)
            out.backward(torch.randn(out.shape, generator=gen.manual_seed(3)))
        assert bool(seen.found) != wrap, seen.found  # the plain mask's backward selects
        assert type(out) is torch.Tensor
        results.append((out.detach(), embeds.grad, features.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    wrapped = PlaceholderMask.of(mask, 3)
    assert type(wrapped[..., 0]) is torch.Tensor and torch.equal(wrapped[..., 0], mask[..., 0])
