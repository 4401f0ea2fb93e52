"""PinnedStaging: micro-batches reach the device in one copy through reused host buffers."""

from __future__ import annotations

import torch

from trainer_core import PinnedStaging

CPU = torch.device("cpu")


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
