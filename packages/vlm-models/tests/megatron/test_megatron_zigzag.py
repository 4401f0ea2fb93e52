"""The zigzag split's index maps on the host (no process group): every padded slot on one CP
rank, chunks ``r`` and ``2 cp - 1 - r`` of each sample on rank ``r``, the ranks' parts
reassembling the row, and each rank finding the rows it holds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from vlm_models.megatron.context_parallel import ZigzagLayout

LENGTHS = [5, 9, 3]


@pytest.mark.parametrize(("cp", "multiple"), [(2, 1), (2, 2), (4, 1)])
def test_parts_reassemble_the_row(cp: int, multiple: int) -> None:
    layouts = [
        ZigzagLayout.build(LENGTHS, cp=cp, rank=r, group=None, multiple=multiple) for r in range(cp)
    ]
    unit = 2 * cp * multiple
    assert all(p % unit == 0 and p - n < unit for p, n in zip(
        layouts[0].padded_lengths, LENGTHS, strict=True))  # fmt: skip
    row = torch.arange(1, sum(LENGTHS) + 1).float()  # 0 marks padding below
    parts = [z.split(row) for z in layouts]
    assert len({len(p) for p in parts}) == 1  # equal shares
    whole = torch.cat(parts)[layouts[0].gather_order]
    assert torch.equal(whole[whole > 0], row)  # every real token once, in order
    cu = layouts[0].padded_cu
    for r, z in enumerate(layouts):
        assert torch.equal(z.local_of_padded(whole), parts[r])
        chunk = z.padded_lengths[1] // (2 * cp)
        offset, pos = z.local_span(1)
        first = [cu[1] + c * chunk for c in (r, 2 * cp - 1 - r)]
        assert z.local_slots[offset : offset + 2 * chunk].tolist() == [
            f + i for f in first for i in range(chunk)
        ]
        assert pos.tolist() == [s - cu[1] for s in z.local_slots[offset : offset + 2 * chunk]]
    rows = torch.arange(sum(LENGTHS))
    owned = [z.owned_rows(rows) for z in layouts]
    assert torch.equal(sum(m.int() for m, _ in owned), torch.ones_like(rows, dtype=torch.int))
    for (mine, local), part in zip(owned, parts, strict=True):
        assert torch.equal(part[local], row[mine])
