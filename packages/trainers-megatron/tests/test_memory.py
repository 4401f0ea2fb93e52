"""The Megatron backend's memory estimate (``MegatronConfig.state_bytes``) and how it names a
layout, on plain numbers (the 2B and 8B Qwen3-VL shapes; tests/test_model_loading.py checks
the shapes against the real configs)."""

from __future__ import annotations

import dataclasses

import pytest

from rl_algos.run_context import ModelShape, ParallelLayout, TrainLayout
from trainers_megatron import MegatronConfig

GiB = 1 << 30
# vlm_models.parameter_counts of the qwen3-vl-2b / qwen3-vl-8b presets
QWEN3_VL_2B = ModelShape(1_720_574_976, 406_957_056, 2048, 6144, 28, 151936, 1024, 4096, 24)
QWEN3_VL_8B = ModelShape(8_190_735_360, 576_388_336, 4096, 12288, 36, 151936, 1152, 4304, 27)
DIST, PLAIN = MegatronConfig(), MegatronConfig(distributed_optimizer=False)


def layout(world: int, tokens: int, longest: int = 0, **parallel) -> TrainLayout:
    return TrainLayout(world, tokens, ParallelLayout(**parallel), longest)


def test_one_gpu_2b_matches_the_measured_h200_run():
    """docs/performance.md and issue 19: 8 x 1,024 tokens with one image patch per token on
    one H200, 69 GiB peak allocated. The estimate (without the reserve) stays within 15%, above."""
    held = DIST.state_bytes(QWEN3_VL_2B, layout(1, 8192), vision_patches_per_token=1)
    total = held.weights + held.gradients + held.optimizer + held.activations + held.logits
    assert 69 * GiB <= total <= 1.15 * 69 * GiB


def test_megatron_splits_by_tp_and_shards_the_optimizer_over_dp():
    """The plain optimizer keeps AdamW state whole on every data-parallel rank (the vision
    tower whole on every tensor-parallel rank); the distributed optimizer, the default, shards
    masters, moments and float32 gradients over the DP ranks."""
    shape = QWEN3_VL_8B
    held4 = shape.language_params / 4 + shape.vision_params
    assert PLAIN.state_bytes(shape, layout(8, 4096)).optimizer == 12 * (
        shape.language_params + shape.vision_params
    )
    plain4 = PLAIN.state_bytes(shape, layout(8, 4096, tp=4))
    assert plain4.optimizer == 12 * held4
    dist4 = DIST.state_bytes(shape, layout(8, 4096, tp=4))  # DP2
    assert dist4.optimizer == pytest.approx(12 * held4 / 2)
    assert dist4.gradients == pytest.approx(2 * held4 + 4 * held4 / 2)
    assert dist4.weights == plain4.weights


def test_pipeline_and_expert_parallel_split_the_weights():
    """PP splits the language model over stages; EP splits the routed experts, whose
    optimizer state is sharded over the expert-data-parallel ranks (DP / EP)."""
    moe = ModelShape(30_000_000_000, 500_000_000, 2048, 6144, 48, 151936, 1024, 4096, 24,
                     expert_params=28_000_000_000)  # fmt: skip
    dense = moe.language_params - moe.expert_params
    assert PLAIN.state_bytes(moe, layout(8, 4096)).weights == 2 * (
        moe.language_params + moe.vision_params
    )
    pp2 = layout(8, 4096, pp=2)
    assert PLAIN.state_bytes(moe, pp2).weights == 2 * (moe.language_params / 2 + moe.vision_params)
    assert PLAIN.state_bytes(moe, layout(8, 4096, ep=4)).weights == 2 * (
        dense + moe.expert_params / 4 + moe.vision_params
    )
    sharded = DIST.state_bytes(moe, layout(8, 4096, ep=4))  # DP8, expert DP2
    expected = dense / 8 + moe.vision_params / 8 + moe.expert_params / 4 / 2
    assert sharded.optimizer == pytest.approx(12 * expected)
    assert DIST.describe_layout(layout(8, 4096, ep=4))[:3] == ["megatron TP1", "EP4", "DP8"]
    flags = PLAIN.layout_flags(pp2)
    assert "--pipeline-parallel 2" in flags and "--no-distributed-optimizer" in flags
    # the slime recipe's 35B-A3B layout: attention over TP2, whole experts (expert TP 1) over
    # EP8, so each rank holds 1/8 of the experts (not 1/16) and expert DP is 1
    recipe = layout(8, 4096, tp=2, ep=8, etp=1)
    held = DIST.state_bytes(moe, recipe)
    assert held.weights == pytest.approx(
        2 * (dense / 2 + moe.vision_params + moe.expert_params / 8)
    )
    assert held.optimizer == pytest.approx(
        12 * ((dense / 2 + moe.vision_params) / 4 + moe.expert_params / 8)
    )
    assert DIST.describe_layout(recipe)[1:4] == ["EP8", "ETP1", "DP4"]
    assert "--expert-tensor-parallel 1" in DIST.layout_flags(recipe)


def test_recompute_and_sequence_parallel_cut_activations():
    plain = DIST.state_bytes(QWEN3_VL_8B, layout(8, 16384, tp=4)).activations
    sp = DIST.state_bytes(QWEN3_VL_8B, layout(8, 16384, tp=4, sp=True)).activations
    both = layout(8, 16384, tp=4, sp=True, recompute="full")
    assert DIST.state_bytes(QWEN3_VL_8B, both).activations < sp < plain
    selective = layout(8, 16384, tp=4, sp=True, recompute="selective")
    assert DIST.state_bytes(QWEN3_VL_8B, selective).activations == sp  # counted as none


def test_context_parallel_splits_a_long_samples_activations():
    """A sample longer than the token budget is one micro-batch: CP divides its tokens per GPU
    (not the budget's), and adds the whole row's gathered keys and values."""
    shape = dataclasses.replace(QWEN3_VL_8B, kv_bytes_per_token=147456)
    one = DIST.state_bytes(shape, layout(8, 8192, 65536))
    four = DIST.state_bytes(shape, layout(8, 8192, 65536, cp=4))
    assert layout(8, 8192, cp=4).dp == 2
    assert layout(8, 8192, 65536, cp=4).tokens_per_gpu == 16384
    assert four.logits == pytest.approx(one.logits / 4)
    assert one.activations / 4 < four.activations < one.activations / 3
    short, short_cp2 = layout(8, 8192, 4096), layout(8, 8192, 4096, cp=2)
    assert DIST.state_bytes(shape, short_cp2).activations > (
        DIST.state_bytes(shape, short).activations
    )  # a sample within the budget gains nothing from CP
    assert "--context-parallel 2" in DIST.layout_flags(short_cp2)
    assert "CP2" in DIST.describe_layout(short_cp2)


def test_megatron_runs_every_split():
    assert DIST.supports(ParallelLayout(tp=2, sp=True, cp=2, pp=2, ep=4, etp=1)) is None
    assert DIST.supports(ParallelLayout(recompute="selective")) is None
