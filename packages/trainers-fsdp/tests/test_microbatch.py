from __future__ import annotations

import itertools

import pytest
import torch

from rl_algos import LOSS_FIELDS
from trainer_core import PinnedStaging, build_micro_batch
from trainers_fsdp import TINY_OVERRIDES
from vlm_models import tiny_config

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


def test_staged_tensors_are_copies_and_the_buffers_are_reused():
    """Each micro-batch's tensors arrive whole (lists concatenated, any dtype and shape) and stay
    intact after later micro-batches reuse the buffers; two buffers serve any number of
    micro-batches, growing only for a larger one."""
    staging = PinnedStaging(slots=2, pin=False)
    gen = torch.Generator().manual_seed(0)
    rows = [(6, 2), (5, 3), (6, 2), (4, 4), (9, 1)]  # two pixel parts of these many rows each
    sent, got = [], []
    for a, b in rows:
        parts = [torch.randn(a, 8, generator=gen), torch.randn(b, 8, generator=gen)]
        ids = torch.randint(0, 1000, (a + b,), generator=gen)
        mask = ids % 2 == 0
        cu = torch.tensor([0, a, a + b], dtype=torch.int32)
        halves = torch.randn(2, 3, generator=gen).bfloat16()
        sent.append([torch.cat(parts), ids, mask, cu, halves, torch.tensor(7.5)])
        got.append(staging.copy_to([parts, ids, mask, cu, halves, torch.tensor(7.5)], CPU))
    for expected, out in zip(sent, got, strict=True):
        for e, o in zip(expected, out, strict=True):
            assert o.dtype == e.dtype and torch.equal(o, e)  # not overwritten later

    # two buffers in turn, each grown only for the largest micro-batch it held (10 and 8 pixel
    # rows; each tensor starts on a 64-byte boundary)
    def size(n: int) -> int:
        return sum(-(-b // 64) * 64 for b in (n * 8 * 4, n * 8, n, 3 * 4, 6 * 2, 4))

    assert staging.nbytes == size(10) + size(8)
    half = [torch.randn(3, 8, generator=gen).bfloat16(), torch.zeros(0, dtype=torch.long)]
    out = staging.copy_to(half, CPU)
    assert torch.equal(out[0], half[0]) and out[1].shape == (0,)
    assert staging.nbytes == size(10) + size(8)  # a smaller micro-batch fits


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
