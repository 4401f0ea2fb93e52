"""The memory estimate's arithmetic, on plain numbers (the 2B and 8B Qwen3-VL shapes; the
cross-package tests check these numbers against the real configs)."""

from __future__ import annotations

import dataclasses

import pytest

from rl_runtime import PreflightError, TrainLayout, check_layout, choose_layout, estimate_memory
from rl_runtime.memory import GiB, ModelShape, keep_train_state_on_gpu

# vlm_models.parameter_counts of the qwen3-vl-2b / qwen3-vl-8b presets
QWEN3_VL_2B = ModelShape(1_720_574_976, 406_957_056, 2048, 6144, 28, 151936, 1024, 4096, 24)
QWEN3_VL_8B = ModelShape(8_190_735_360, 576_388_336, 4096, 12288, 36, 151936, 1152, 4304, 27)
H200 = 141 * GiB


def test_one_gpu_2b_matches_the_measured_h200_runs():
    """docs/performance.md and issue 19: 8 x 1,024 tokens with one image patch per token on
    one H200, peak allocated (so without the reserve). The estimate stays within 15%, above."""
    fsdp = estimate_memory(QWEN3_VL_2B, TrainLayout("fsdp", 1, 8192), vision_patches_per_token=1)
    megatron = estimate_memory(
        QWEN3_VL_2B, TrainLayout("megatron", 1, 8192), vision_patches_per_token=1
    )
    params = QWEN3_VL_2B.language_params + QWEN3_VL_2B.vision_params
    without_fp32_grads = fsdp.total - fsdp.reserve - 4 * params  # one micro-batch: none
    assert 57.7 * GiB <= without_fp32_grads <= 1.15 * 57.7 * GiB
    assert 69 * GiB <= megatron.total - megatron.reserve <= 1.15 * 69 * GiB


def test_fsdp_shards_the_training_state_over_the_world():
    one = estimate_memory(QWEN3_VL_8B, TrainLayout("fsdp", 1, 4096))
    eight = estimate_memory(QWEN3_VL_8B, TrainLayout("fsdp", 8, 4096))
    replicated = estimate_memory(QWEN3_VL_8B, TrainLayout("fsdp", 8, 4096, replicate=True))
    assert eight.optimizer == pytest.approx(one.optimizer / 8)
    assert eight.gradients == pytest.approx(one.gradients / 8)
    assert eight.weights > one.weights / 8  # the gathered units are whole
    assert replicated.optimizer == one.optimizer and eight.activations == one.activations


def test_megatron_splits_by_tp_and_shards_the_optimizer_over_dp():
    """The plain optimizer keeps AdamW state whole on every data-parallel rank (the vision
    tower whole on every tensor-parallel rank); the distributed optimizer, the default, shards
    masters, moments and float32 gradients over the DP ranks."""
    shape = QWEN3_VL_8B
    held4 = shape.language_params / 4 + shape.vision_params
    plain1 = estimate_memory(shape, TrainLayout("megatron", 8, 4096, distributed_optimizer=False))
    plain4 = TrainLayout("megatron", 8, 4096, tp=4, distributed_optimizer=False)
    assert plain1.optimizer == 12 * (shape.language_params + shape.vision_params)
    assert estimate_memory(shape, plain4).optimizer == 12 * held4
    dist4 = estimate_memory(shape, TrainLayout("megatron", 8, 4096, tp=4))  # DP2
    assert dist4.optimizer == pytest.approx(12 * held4 / 2)
    assert dist4.gradients == pytest.approx(2 * held4 + 4 * held4 / 2)
    assert dist4.weights == estimate_memory(shape, plain4).weights


def test_pipeline_and_expert_parallel_split_the_weights():
    """PP splits the language model over stages; EP splits the routed experts, whose
    optimizer state is sharded over the expert-data-parallel ranks (DP / EP)."""
    moe = ModelShape(30_000_000_000, 500_000_000, 2048, 6144, 48, 151936, 1024, 4096, 24,
                     expert_params=28_000_000_000)  # fmt: skip
    dense = moe.language_params - moe.expert_params
    one = TrainLayout("megatron", 8, 4096, distributed_optimizer=False)
    pp2 = TrainLayout("megatron", 8, 4096, pp=2, distributed_optimizer=False)
    ep4 = TrainLayout("megatron", 8, 4096, ep=4, distributed_optimizer=False)
    assert estimate_memory(moe, one).weights == 2 * (moe.language_params + moe.vision_params)
    assert estimate_memory(moe, pp2).weights == 2 * (moe.language_params / 2 + moe.vision_params)
    assert estimate_memory(moe, ep4).weights == 2 * (
        dense + moe.expert_params / 4 + moe.vision_params
    )
    sharded = estimate_memory(moe, TrainLayout("megatron", 8, 4096, ep=4))  # DP8, expert DP2
    expected = dense / 8 + moe.vision_params / 8 + moe.expert_params / 4 / 2
    assert sharded.optimizer == pytest.approx(12 * expected)
    assert "megatron TP1, EP4, DP8" in TrainLayout("megatron", 8, 4096, ep=4).describe()
    assert "--pipeline-parallel 2" in pp2.flags() and "--no-distributed-optimizer" in pp2.flags()
    # the slime recipe's 35B-A3B layout: attention over TP2, whole experts (expert TP 1) over
    # EP8, so each rank holds 1/8 of the experts (not 1/16) and expert DP is 1
    recipe = TrainLayout("megatron", 8, 4096, tp=2, ep=8, etp=1)
    held = estimate_memory(moe, recipe)
    assert held.weights == pytest.approx(
        2 * (dense / 2 + moe.vision_params + moe.expert_params / 8)
    )
    assert held.optimizer == pytest.approx(
        12 * ((dense / 2 + moe.vision_params) / 4 + moe.expert_params / 8)
    )
    assert "EP8, ETP1, DP4" in recipe.describe()
    assert "--expert-tensor-parallel 1" in recipe.flags()


def test_recompute_and_sequence_parallel_cut_activations():
    base = TrainLayout("megatron", 8, 16384, tp=4)
    plain = estimate_memory(QWEN3_VL_8B, base).activations
    sp = estimate_memory(QWEN3_VL_8B, TrainLayout("megatron", 8, 16384, tp=4, sp=True))
    both = TrainLayout("megatron", 8, 16384, tp=4, sp=True, recompute=True)
    assert estimate_memory(QWEN3_VL_8B, both).activations < sp.activations < plain
    fsdp = estimate_memory(QWEN3_VL_8B, TrainLayout("fsdp", 8, 16384))
    fsdp_rc = estimate_memory(QWEN3_VL_8B, TrainLayout("fsdp", 8, 16384, recompute=True))
    assert fsdp_rc.activations < fsdp.activations / 5


def test_8b_at_tp1_is_refused_with_numbers_and_a_layout_that_fits():
    """The issue's arithmetic: with the optimizer state whole on every rank (the plain
    optimizer) ~160 GB of training state per GPU at TP=1, more than an H200."""
    layout = TrainLayout("megatron", 8, 16384, distributed_optimizer=False)
    with pytest.raises(PreflightError) as err:
        check_layout(QWEN3_VL_8B, layout, H200, model="Qwen3-VL-8B-Instruct")
    message = err.value.message
    assert "Qwen3-VL-8B-Instruct (8.77B parameters) does not fit in 141.0 GiB" in message
    assert "megatron TP1" in message and "optimizer 98.0" in message
    assert "Try --backend megatron --tensor-parallel 2 --sequence-parallel" in message
    assert "--no-distributed-optimizer" in message  # the suggestion keeps the user's choice
    assert "or --backend fsdp" in message
    assert "\n" not in message
    chosen, estimate = choose_layout(QWEN3_VL_8B, layout, H200)
    assert (chosen.tp, chosen.sp, chosen.recompute) == (2, True, True)
    assert estimate.total <= H200 and check_layout(QWEN3_VL_8B, chosen, H200) == estimate


def test_distributed_optimizer_lets_8b_train_without_tensor_parallelism():
    """The default: masters and moments sharded over 8 DP ranks (98 GiB -> 12 GiB), so TP=1
    with recomputation fits an H200, and an 80 GB GPU too."""
    layout = TrainLayout("megatron", 8, 16384)
    with pytest.raises(PreflightError, match=r"optimizer 12\.2"):  # activations: recompute
        check_layout(QWEN3_VL_8B, layout, H200)
    for gpu in (H200, 80 * GiB):
        chosen, estimate = choose_layout(QWEN3_VL_8B, layout, gpu)
        assert (chosen.tp, chosen.recompute, chosen.distributed_optimizer) == (1, True, True)
        assert estimate.total <= gpu


def test_80gb_gpus_get_the_recipes_tp4_layout():
    """On 80 GB GPUs, with the plain optimizer, the first megatron layout that fits is the miles
    recipe's for 8B."""
    plain = TrainLayout("megatron", 8, 16384, distributed_optimizer=False)
    chosen, _ = choose_layout(QWEN3_VL_8B, plain, 80 * GiB)
    assert (chosen.tp, chosen.sp, chosen.recompute) == (4, True, True)


def test_nothing_fits_says_so():
    with pytest.raises(PreflightError, match="No layout on this many GPUs fits"):
        check_layout(QWEN3_VL_8B, TrainLayout("fsdp", 1, 16384), 24 * GiB)


def _shape(kv_bytes_per_token: int) -> ModelShape:
    return ModelShape(
        language_params=1_700_000_000,
        vision_params=400_000_000,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        vocab_size=151_936,
        kv_bytes_per_token=kv_bytes_per_token,
    )


def test_train_state_stays_where_the_engine_keeps_its_rollout():
    """The state (20 bytes a parameter on one GPU) stays when the engine's share of what is
    left holds the rollout's KV cache; more sequences, or a cache of unknown size, offload."""
    shape = _shape(114_688)
    estimate = estimate_memory(shape, TrainLayout("fsdp", 1, 16384))
    kw = {"gpu_bytes": 141 * GiB, "tokens_per_sequence": 1408, "engine_share": 0.5}
    keep, why = keep_train_state_on_gpu(shape, estimate, engine_sequences=128, **kw)
    assert keep and "trainer state 39.1 GiB" in why, why
    assert not keep_train_state_on_gpu(shape, estimate, engine_sequences=512, **kw)[0]
    unknown = _shape(0)
    assert not keep_train_state_on_gpu(unknown, estimate, engine_sequences=1, **kw)[0]


def test_context_parallel_splits_a_long_samples_activations():
    """A sample longer than the token budget is one micro-batch: CP divides its tokens per GPU
    (not the budget's), and adds the whole row's gathered keys and values."""
    shape = QWEN3_VL_8B.__class__(**{**QWEN3_VL_8B.__dict__, "kv_bytes_per_token": 147456})
    long = dict(max_tokens_per_gpu=8192, longest_sample=65536)
    one = estimate_memory(shape, TrainLayout("megatron", 8, **long))
    four = estimate_memory(shape, TrainLayout("megatron", 8, cp=4, **long))
    assert TrainLayout("megatron", 8, 8192, cp=4).dp == 2
    assert TrainLayout("megatron", 8, cp=4, **long).tokens_per_gpu == 16384
    assert four.logits == pytest.approx(one.logits / 4)
    assert one.activations / 4 < four.activations < one.activations / 3
    short = TrainLayout("megatron", 8, 8192, longest_sample=4096)
    assert estimate_memory(shape, dataclasses.replace(short, cp=2)).activations > (
        estimate_memory(shape, short).activations
    )  # a sample within the budget gains nothing from CP


def test_context_parallel_is_chosen_for_long_samples_when_nothing_else_fits():
    """8B, 256K-token samples on 16 H200s: TP 8 with recomputation holds no whole sample,
    TP 8 x CP 2 does."""
    long = TrainLayout("megatron", 16, 8192, longest_sample=262144)
    without = estimate_memory(QWEN3_VL_8B, dataclasses.replace(long, tp=8, sp=True, recompute=True))
    assert without.total > H200
    chosen, estimate = choose_layout(QWEN3_VL_8B, long, H200)
    assert chosen.cp > 1 and estimate.total <= H200
    assert chosen.world_size % (chosen.tp * chosen.cp) == 0
    assert "--context-parallel" in chosen.flags() and f"CP{chosen.cp}" in chosen.describe()
    short = TrainLayout("megatron", 8, 8192, longest_sample=4096)
    assert choose_layout(QWEN3_VL_8B, short, H200)[0].cp == 1
