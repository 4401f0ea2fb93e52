from __future__ import annotations

import itertools

import pytest
import torch

from rl_algos import LOSS_FIELDS
from trainer_core import PinnedStaging, build_micro_batch
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
