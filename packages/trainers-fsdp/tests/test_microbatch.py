from __future__ import annotations

import pytest

from trainers_fsdp import TINY_OVERRIDES
from trainers_fsdp.microbatch import build_micro_batch
from vlm_models import tiny_config


def test_image_placeholder_count_is_checked_on_the_host(batch):
    """The model's device-side count check is removed (a host sync), so a sample whose image
    placeholders do not match its image must be refused here, by name."""
    config = tiny_config(**TINY_OVERRIDES)
    mb = build_micro_batch(batch, [0, 1, 2], config, need_vision=False)
    assert mb.image_grid_thw.shape[0] == 2
    ids = batch.input_ids[2].clone()
    flat = ids.reshape(-1)
    flat[(flat == config.image_token_id).nonzero()[0]] = 0  # one placeholder lost
    batch.input_ids[2] = ids
    with pytest.raises(ValueError, match=r"sample 2: 5 image placeholder tokens .* 6 merged"):
        build_micro_batch(batch, [0, 1, 2], config, need_vision=False)
    build_micro_batch(batch, [0, 1, 3], config, need_vision=False)  # the others still build
