"""TrainBatch validation/selection and packing helpers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos import TrainBatch, pack_by_token_budget, pack_sequences, unpack_sequences


def _batch():
    ids = [torch.arange(3), torch.arange(5), torch.arange(2)]
    return TrainBatch(
        input_ids=ids,
        loss_mask=[
            torch.tensor([0.0, 1, 1]),
            torch.tensor([0.0, 0, 1, 1, 1]),
            torch.tensor([0.0, 1]),
        ],
        advantages=[torch.full((len(t),), float(i)) for i, t in enumerate(ids)],
        pixel_values=[torch.zeros(4, 6), None, torch.ones(8, 6)],
        image_grid_thw=[torch.tensor([[1, 2, 2]]), None, torch.tensor([[1, 2, 4]])],
    )


def test_batch_basics_and_select():
    b = _batch()
    assert len(b) == 3 and b.lengths == [3, 5, 2] and b.num_tokens == 10
    s = b.select([2, 0])
    assert s.lengths == [2, 3]
    assert s.advantages[0][0].item() == 2.0
    assert s.pixel_values[0].shape == (8, 6) and s.old_logprobs is None


def test_batch_rejects_misaligned_fields():
    with pytest.raises(ValueError, match=r"loss_mask\[1\]"):
        TrainBatch(
            input_ids=[torch.arange(3), torch.arange(2)], loss_mask=[torch.ones(3), torch.ones(3)]
        )
    with pytest.raises(ValueError, match="entries"):
        TrainBatch(input_ids=[torch.arange(3)], loss_mask=[torch.ones(3), torch.ones(3)])


def test_pack_unpack_roundtrip():
    parts = [torch.arange(3), torch.arange(5) + 10, torch.arange(1) + 20]
    packed, cu = pack_sequences(parts)
    assert cu.tolist() == [0, 3, 8, 9] and cu.dtype == torch.int32
    assert all(torch.equal(a, b) for a, b in zip(unpack_sequences(packed, cu), parts, strict=True))
    with pytest.raises(ValueError, match="cu_seqlens"):
        unpack_sequences(packed, [0, 3])


def test_pack_by_token_budget_hand_case():
    # longest first: 12 (over budget, alone), 9, 5 (new bin), 3 -> with 5, 2 -> with 5, 1 -> with 9
    assert pack_by_token_budget([5, 3, 9, 2, 12, 1], 10) == [[0, 1, 3], [2, 5], [4]]
    with pytest.raises(ValueError):
        pack_by_token_budget([1], 0)


def test_pack_by_token_budget_spreads_instead_of_leaving_a_remainder():
    # first fit alone gives 9, 9, 3 tokens; dealt to the emptiest, the same three hold 9, 6, 6
    assert pack_by_token_budget([3] * 7, 9) == [[0, 3, 6], [1, 4], [2, 5]]
    # a GRPO step's 128 responses at a 16k budget: as many micro-batches as first fit needs,
    # none of them a small remainder
    lengths = [600 + (i * 37) % 400 for i in range(128)]
    bins = pack_by_token_budget(lengths, 16384)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert len(bins) == -(-sum(lengths) // 16384) and max(loads) <= 16384
    assert max(loads) - min(loads) <= max(lengths)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=50), max_size=30), st.integers(1, 60))
def test_pack_by_token_budget_properties(lengths, budget):
    bins = pack_by_token_budget(lengths, budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    for b in bins:
        assert b == sorted(b)
        total = sum(lengths[i] for i in b)
        assert total <= budget or len(b) == 1
    # never more micro-batches than first fit decreasing would use
    first_fit: list[int] = []
    for length in sorted((x for x in lengths if x <= budget), reverse=True):
        free = next((j for j, load in enumerate(first_fit) if load + length <= budget), None)
        if free is None:
            first_fit.append(length)
        else:
            first_fit[free] += length
    assert len(bins) <= len(first_fit) + sum(x > budget for x in lengths)


def test_routed_experts_align_with_input_ids_and_are_selected():
    """Per sample ``[L_i, layers, k]`` integer ids; a misaligned or float one is refused by
    name, and ``select`` carries them."""
    b = _batch()
    routes = [torch.randint(0, 8, (n, 4, 2), dtype=torch.int16) for n in b.lengths]
    routed = TrainBatch(input_ids=b.input_ids, loss_mask=b.loss_mask, routed_experts=routes)
    assert routed.select([2, 0]).routed_experts[0] is routes[2]
    bad = [routes[0], routes[1][:-1], routes[2]]
    with pytest.raises(ValueError, match=r"routed_experts\[1\] has shape \(4, 4, 2\).*\(5, "):
        TrainBatch(input_ids=b.input_ids, loss_mask=b.loss_mask, routed_experts=bad)
    flat = [routes[0], routes[1][:, 0], routes[2]]  # one layer dimension lost
    with pytest.raises(ValueError, match=r"routed_experts\[1\]"):
        TrainBatch(input_ids=b.input_ids, loss_mask=b.loss_mask, routed_experts=flat)
    other_k = [routes[0], routes[1], routes[2][..., :1]]
    with pytest.raises(ValueError, match=r"routed_experts\[2\] has \(layers, top_k\) \(4, 1\)"):
        TrainBatch(input_ids=b.input_ids, loss_mask=b.loss_mask, routed_experts=other_k)
    floats = [r.float() for r in routes]
    with pytest.raises(ValueError, match="not expert ids"):
        TrainBatch(input_ids=b.input_ids, loss_mask=b.loss_mask, routed_experts=floats)
