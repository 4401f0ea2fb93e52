"""GRPO advantages and reward post-processing: hand values, the float32 artifact, properties."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rl_algos import (
    broadcast_advantages,
    compute_grpo_advantages,
    filter_zero_variance_groups,
    whiten_advantages,
)

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def naive_float32_advantages(rewards: list[float], group_size: int) -> torch.Tensor:
    """The usual recipe: float32 rewards, group mean/std in float32, no special case."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    mean = r.mean(dim=-1, keepdim=True)
    std = r.std(dim=-1, keepdim=True)
    return ((r - mean) / (std + 1e-6)).flatten()


def test_hand_values_std_normalised():
    adv = compute_grpo_advantages([1.0, 0.0, 0.0, 1.0], group_size=2, eps=0.0)
    s = 1 / math.sqrt(0.5)  # (1 - 0.5) / unbiased std sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5 * s, -0.5 * s, -0.5 * s, 0.5 * s]))


def test_hand_values_dr_grpo_no_std():
    adv = compute_grpo_advantages(
        [1.0, 0.0, 0.0, 0.0], group_size=4, std_normalization=False, reward_dtype=torch.float64
    )
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))


def test_uneven_interleaved_groups_normalised_per_group():
    rewards = [1.0, 1.0, 0.0, 0.0, 0.0]
    ids = [7, 3, 7, 7, 3]  # group 7 = samples 0, 2, 3; group 3 = samples 1, 4
    adv = compute_grpo_advantages(rewards, group_ids=ids, eps=0.0, reward_dtype=torch.float64)
    g7_std = math.sqrt((4 / 9 + 1 / 9 + 1 / 9) / 2)  # values 2/3, -1/3, -1/3
    g3_std = math.sqrt(0.5)
    expected = [(2 / 3) / g7_std, 0.5 / g3_std, (-1 / 3) / g7_std, (-1 / 3) / g7_std, -0.5 / g3_std]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    # A batch-wide normalisation would give a different answer: prove the grouping matters.
    whole = compute_grpo_advantages(rewards, group_ids=[0] * 5, reward_dtype=torch.float64)
    assert not torch.allclose(adv, whole)


def test_group_of_one_is_zero():
    adv = compute_grpo_advantages([0.3, 1.0, 0.0], group_ids=[0, 1, 1])
    assert adv[0].item() == 0.0


def test_naive_float32_has_artifact_ours_does_not():
    """The recipes' failure: 0.9 rewards in one group of 8 give reward - mean != 0 in float32."""
    rewards = [0.9] * 8 + [0.9, 0.0, 0.9, 0.0, 0.9, 0.9, 0.0, 0.9]
    naive = naive_float32_advantages(rewards, group_size=8)
    centred = torch.tensor(rewards[:8]) - torch.tensor(rewards[:8]).mean()
    # whether float32 0.9 - mean(8 x 0.9) is 0 depends on the order this torch sums in (a
    # pairwise sum of 8 equal values is exact); where it is not 0, the naive path amplifies it
    if (centred != 0).any():
        assert naive[:8].abs().max() > 0.01  # a spurious advantage, amplified by the tiny std
    for dtype in ALL_DTYPES:
        ours = compute_grpo_advantages(rewards, group_size=8, reward_dtype=dtype)
        assert ours.dtype == dtype
        assert (ours[:8] == 0).all()
        assert (ours[8:] != 0).all()


def test_reward_dtype_float16_rounds_first():
    adv16 = compute_grpo_advantages([0.9, 0.0], group_size=2, reward_dtype=torch.float16)
    assert adv16.dtype == torch.float16
    torch.testing.assert_close(adv16.float(), torch.tensor([0.7071, -0.7071]), atol=1e-3, rtol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        compute_grpo_advantages([1.0, 0.0])
    with pytest.raises(ValueError, match="group_size"):
        compute_grpo_advantages([1.0, 0.0, 1.0], group_size=2)
    with pytest.raises(ValueError, match="NaN"):
        compute_grpo_advantages([1.0, float("nan")], group_size=2)
    with pytest.raises(ValueError, match="reward_dtype"):
        compute_grpo_advantages([1.0, 0.0], group_size=2, reward_dtype=torch.int64)


def test_broadcast_over_mask():
    out = broadcast_advantages(
        torch.tensor([2.0, -1.0]), [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])]
    )
    torch.testing.assert_close(out[0], torch.tensor([0.0, 2.0, 2.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 0.0, -1.0, -1.0]))


def test_whiten_hand_values():
    adv = [torch.tensor([0.0, 1.0, 3.0]), torch.tensor([5.0, 0.0])]
    mask = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0])]
    out = whiten_advantages(adv, mask, eps=0.0)  # masked values 1, 3: mean 2, std sqrt(2)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(out[0], torch.tensor([0.0, -s, s]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 0.0]))
    scaled = whiten_advantages(adv, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(scaled[0], torch.tensor([0.0, s, 3 * s]))


def test_dynamic_sampling_filter_reports_dropped_groups():
    rewards = [1, 1, 0, 1, 0, 0, 0.9, 0.9]
    res = filter_zero_variance_groups(torch.tensor(rewards, dtype=torch.float32), group_size=2)
    assert res.keep_indices.tolist() == [2, 3]
    assert (res.num_groups, res.num_dropped_groups) == (4, 3)
    res = filter_zero_variance_groups([1.0, 0.0, 1.0, 1.0], group_ids=[5, 5, 2, 2])
    assert res.keep_indices.tolist() == [0, 1]
    assert res.num_dropped_groups == 1


# ---- properties -------------------------------------------------------------------------------

reward_values = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9, 1.0, -1.0, 3.0])
groups = st.lists(st.lists(reward_values, min_size=1, max_size=9), min_size=1, max_size=6)


def _flatten(gs: list[list[float]]) -> tuple[list[float], list[int]]:
    rewards = [r for g in gs for r in g]
    ids = [k for k, g in enumerate(gs) for _ in g]
    return rewards, ids


@settings(max_examples=60, deadline=None)
@given(groups, st.booleans())
def test_property_per_group_sum_zero(gs, std_norm):
    rewards, ids = _flatten(gs)
    adv = compute_grpo_advantages(
        rewards, group_ids=ids, std_normalization=std_norm, reward_dtype=torch.float64
    )
    ids_t = torch.tensor(ids)
    for k in range(len(gs)):
        assert abs(adv[ids_t == k].sum().item()) < 1e-9


@settings(max_examples=60, deadline=None)
@given(
    st.floats(min_value=-6e4, max_value=6e4, allow_nan=False),
    st.integers(min_value=1, max_value=16),
    st.sampled_from(ALL_DTYPES),
    st.booleans(),
)
def test_property_constant_group_exact_zero(value, size, dtype, std_norm):
    rewards = [value] * size + [0.0, 1.0]  # plus one non-constant group
    ids = [0] * size + [1, 1]
    adv = compute_grpo_advantages(
        rewards, group_ids=ids, std_normalization=std_norm, reward_dtype=dtype
    )
    assert adv.dtype == dtype
    assert (adv[:size] == 0.0).all()


@settings(max_examples=60, deadline=None)
@given(groups, st.floats(min_value=-10, max_value=10, allow_nan=False))
@example([[0.0, 0.1, 0.25]], 8.0)  # found by hypothesis: lists were rounded to float32 first
def test_property_shift_invariance(gs, shift):
    rewards, ids = _flatten(gs)
    a = compute_grpo_advantages(rewards, group_ids=ids, reward_dtype=torch.float64)
    b = compute_grpo_advantages(
        [r + shift for r in rewards], group_ids=ids, reward_dtype=torch.float64
    )
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(groups)
def test_property_sign_follows_reward(gs):
    rewards, ids = _flatten(gs)
    adv = compute_grpo_advantages(rewards, group_ids=ids, reward_dtype=torch.float64)
    start = 0
    for g in gs:
        mean = sum(g) / len(g)
        for j, r in enumerate(g):
            a = adv[start + j].item()
            if max(g) == min(g):
                assert a == 0.0
            elif r > mean + 1e-9:
                assert a > 0
            elif r < mean - 1e-9:
                assert a < 0
        start += len(g)
