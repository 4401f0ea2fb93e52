from __future__ import annotations

import pytest
import torch

from trainers_fsdp import TINY_OVERRIDES
from trainers_fsdp.microbatch import PinnedStaging, build_micro_batch
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


def test_staged_pixels_are_copies_and_the_buffers_are_reused():
    """Each micro-batch's pixels arrive whole and stay intact after later micro-batches reuse
    the buffers; two buffers serve any number of micro-batches, growing only for a larger one."""
    staging = PinnedStaging(slots=2, pin=False)
    gen = torch.Generator().manual_seed(0)
    rows = [(6, 2), (5, 3), (6, 2), (4, 4), (9, 1)]  # two parts of these many rows each
    sent, got = [], []
    for a, b in rows:
        parts = [torch.randn(a, 8, generator=gen), torch.randn(b, 8, generator=gen)]
        sent.append(torch.cat(parts))
        got.append(staging.copy_to(parts, torch.device("cpu")))
    for expected, out in zip(sent, got, strict=True):
        assert torch.equal(out, expected)  # not overwritten by a later micro-batch
    # two buffers in turn, each grown only for the largest micro-batch it held (10, 8 rows)
    assert staging.nbytes == (10 + 8) * 8 * 4
    half = [torch.randn(3, 8, generator=gen).bfloat16()]
    assert torch.equal(staging.copy_to(half, torch.device("cpu")), half[0])
    assert staging.nbytes == (10 + 8) * 8 * 4  # a smaller micro-batch of another dtype fits
