"""The vision tower with host-precomputed inputs and the fused attention: the same features and
gradients as transformers' own forward."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from trainers_fsdp.vision import VisionInputs
from vlm_models.classes import select_classes


def _two_images(batch):
    pixels = torch.cat([batch.pixel_values[0], batch.pixel_values[2]])
    grid = torch.cat([batch.image_grid_thw[0], batch.image_grid_thw[2]])
    return pixels, grid


def _run(model, pixels, grid, inputs: VisionInputs | None = None, precomputed=None):
    model.zero_grad()
    with nullcontext() if inputs is None else inputs.use(precomputed):
        out = model.model.visual(pixels, grid_thw=grid)
    feats = out.pooler_output
    feats = torch.cat(feats) if isinstance(feats, (list, tuple)) else feats
    deep = torch.cat(
        [torch.cat(d) if isinstance(d, (list, tuple)) else d for d in out.deepstack_features]
    )
    (feats.square().mean() + deep.square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat([feats.detach(), deep.detach()]), grads


def _assert_same(got, ref):
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-4)
    for name, g in ref[1].items():
        torch.testing.assert_close(got[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_precomputed_inputs_equal_the_towers_own(make_plain_model, batch):
    """Two images of different sizes: the hook's inputs give the tower's exact forward."""
    plain, hooked = make_plain_model(), make_plain_model()
    inputs = VisionInputs.attach(hooked)
    assert inputs is not None, "transformers' vision forward no longer takes precomputed keys"
    pixels, grid = _two_images(batch)
    assert len({tuple(g) for g in grid.tolist()}) == 2
    pre = inputs.compute(grid)
    assert pre["max_seqlen"] == int(grid[:, 1:].prod(-1).max())
    ref = _run(plain, pixels, grid)
    _assert_same(_run(hooked, pixels, grid, inputs, pre), ref)
    # outside `use` nothing is injected: the tower computes its inputs itself
    _assert_same(_run(hooked, pixels, grid), ref)


def test_repeated_images_are_computed_once_and_equal_transformers(make_plain_model):
    """A micro-batch repeats a group's image: per-image parts, concatenated, equal what
    transformers' helpers compute for the whole grid (which would redo every repeat)."""
    from transformers import vision_utils

    model = make_plain_model()
    inputs = VisionInputs.attach(model)
    visual = model.model.visual
    merge = visual.spatial_merge_size
    assert merge == 2
    grid = torch.tensor([[1, 4, 6], [1, 4, 6], [1, 2, 2], [1, 4, 6], [2, 6, 4]])
    got = inputs.compute(grid)
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid,
        num_grid_per_side=visual.num_grid_per_side,
        mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners,
        spatial_merge_size=merge,
    )
    torch.testing.assert_close(got["interp_indices"], indices, rtol=0, atol=0)
    torch.testing.assert_close(got["interp_weights"], weights, rtol=0, atol=0)
    expected_pos = vision_utils.get_vision_position_ids(grid, merge)
    torch.testing.assert_close(got["position_ids"], expected_pos, rtol=0, atol=0)
    torch.testing.assert_close(got["cu_seqlens"], vision_utils.get_vision_cu_seqlens(grid))
    assert got["max_seqlen"] == 24  # one frame of the largest image


def test_precomputed_inputs_are_really_used(make_plain_model, batch):
    """Wrong precomputed position ids change the output, so the hook's values reach the tower."""
    model = make_plain_model()
    inputs = VisionInputs.attach(model)
    pixels, grid = _two_images(batch)
    pre = inputs.compute(grid)
    wrong = dict(pre, position_ids=pre["position_ids"].flip(0))
    ref = _run(model, pixels, grid, inputs, pre)[0]
    assert not torch.allclose(_run(model, pixels, grid, inputs, wrong)[0], ref)


@pytest.mark.parametrize("precompute", [False, True])
def test_fused_vision_attention_matches_transformers(make_plain_model, batch, precompute):
    """Two images in one vision forward: same features and gradients, with ``max_seqlen``
    precomputed (no device read) or not."""
    plain, fused = make_plain_model(), make_plain_model()
    depth = fused.config.vision_config.depth
    assert select_classes(fused, fused_vision_attention=True)["fused_vision_attention"] == depth
    pixels, grid = _two_images(batch)
    inputs = VisionInputs.attach(fused) if precompute else None
    pre = inputs.compute(grid) if precompute else None
    _assert_same(_run(fused, pixels, grid, inputs, pre), _run(plain, pixels, grid))
