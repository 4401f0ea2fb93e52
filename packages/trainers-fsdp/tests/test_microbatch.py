from __future__ import annotations

import itertools

import pytest
import torch

from rl_algos import LOSS_FIELDS
from trainer_core import PinnedStaging, build_micro_batch, replays_routes
from trainers_fsdp.synthetic import TINY_OVERRIDES
from vlm_models.presets import tiny_config

CPU = torch.device("cpu")


def test_image_placeholder_count_is_checked_on_the_host(batch):
    """The model's device-side count check is removed (a host sync), so a sample whose image
    placeholders do not match its image must be refused here, by name."""
    config = tiny_config(**TINY_OVERRIDES)
    mb = build_micro_batch(batch, [0, 1, 2], config, fields=LOSS_FIELDS)
    assert mb.image_grid_thw.shape[0] == 2
    ids = batch.input_ids[2].clone()
    flat = ids.reshape(-1)
    flat[(flat == config.image_token_id).nonzero()[0]] = 0  # one placeholder lost
    batch.input_ids[2] = ids
    with pytest.raises(ValueError, match=r"sample 2: 5 image placeholder tokens .* 6 merged"):
        build_micro_batch(batch, [0, 1, 2], config, fields=LOSS_FIELDS)
    build_micro_batch(batch, [0, 1, 3], config, fields=LOSS_FIELDS)  # the others still build


def test_a_micro_batch_moves_whole(batch):
    """``MicroBatch.to`` through a staging buffer gives every tensor back equal, and adds the
    sample boundaries the packed attention reads."""
    config = tiny_config(**TINY_OVERRIDES)
    mb = build_micro_batch(batch, [0, 1, 3], config, fields=LOSS_FIELDS)
    moved = mb.to(CPU, PinnedStaging(pin=False))
    assert torch.equal(moved.cu_seqlens, torch.tensor([0, *itertools.accumulate(mb.lengths)]))
    assert moved.cu_seqlens.dtype == torch.int32
    for name in ("input_ids", "position_ids", "image_grid_thw", "loss_positions"):
        assert torch.equal(getattr(moved, name), getattr(mb, name)), name
    assert torch.equal(moved.pixel_values, torch.cat(mb.pixel_values))
    assert moved.fields.keys() == mb.fields.keys()
    for k, v in mb.fields.items():
        assert torch.equal(moved.fields[k], v), k


def _routed(batch, config, seed: int = 0) -> list[torch.Tensor]:
    """Random expert ids of each sample, as an engine reports them (int16)."""
    text = config.text_config
    g = torch.Generator().manual_seed(seed)
    shape = (text.num_hidden_layers, text.num_experts_per_tok)
    return [
        torch.randint(0, text.num_experts, (n, *shape), generator=g, dtype=torch.int16)
        for n in batch.lengths
    ]


def test_routed_experts_pack_over_the_row_fillers_included():
    """The real samples' ids in row order, then valid ids (the first k experts) for the dummy
    image and the padding sample; moved whole, int32."""
    from trainers_fsdp.synthetic import synthetic_batch

    config = tiny_config("qwen3-vl-moe-tiny", **TINY_OVERRIDES)
    batch = synthetic_batch(config, [20, 9, 14], image_patches=None)  # text only: dummy added
    batch.routed_experts = _routed(batch, config)
    mb = build_micro_batch(batch, [2, 0], config, need_vision=True, pad_to_multiple=8)
    real = sum(batch.lengths[i] for i in (2, 0))
    assert mb.has_dummy and len(mb.lengths) == 4  # two samples, the dummy, the padding
    assert mb.routed_experts.shape == (sum(mb.lengths), 4, 2)
    assert mb.routed_experts.dtype == torch.int32
    expected = torch.cat([batch.routed_experts[2], batch.routed_experts[0]]).int()
    assert torch.equal(mb.routed_experts[:real], expected)
    fillers = mb.routed_experts[real:]
    assert fillers.shape[0] == sum(mb.lengths[2:]) and torch.all(fillers == torch.tensor([0, 1]))
    moved = mb.to(CPU, PinnedStaging(pin=False))
    assert torch.equal(moved.routed_experts, mb.routed_experts)
    assert build_micro_batch(batch, [1], config, routed_experts=False).routed_experts is None
    assert replays_routes(batch, True) and not replays_routes(batch, False)
    assert not replays_routes(synthetic_batch(config, [9]), True)  # the trainer routes
    alone = build_micro_batch(batch, [], config)  # a rank without samples: the dummy alone
    assert torch.equal(alone.routed_experts, torch.tensor([[[0, 1]] * 4]).int())


def test_routed_experts_that_do_not_fit_the_model_are_refused_by_sample():
    from trainers_fsdp.synthetic import synthetic_batch

    config = tiny_config("qwen3-vl-moe-tiny", **TINY_OVERRIDES)
    batch = synthetic_batch(config, [20, 9], image_patches=None)
    routes = _routed(batch, config)
    batch.routed_experts = [routes[0], routes[1][:, :3]]  # three of four layers
    with pytest.raises(ValueError, match=r"sample 1: routed_experts .* \(9, 3, 2\), expected"):
        build_micro_batch(batch, [0, 1], config)
    routes[1][4, 2, 1] = 8  # the model has experts 0..7
    batch.routed_experts = routes
    with pytest.raises(ValueError, match=r"sample 1: .* ids in \[0, 8\], the model has 8"):
        build_micro_batch(batch, [0, 1], config)
    dense = tiny_config(**TINY_OVERRIDES)
    with pytest.raises(ValueError, match="qwen3_vl, which has no experts"):
        build_micro_batch(batch, [0], dense)
