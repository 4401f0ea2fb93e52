"""Choosing and refusing a training layout with both backends' memory estimates
(rl_runtime.memory asking trainers_fsdp / trainers_megatron configs), on plain numbers: the
8B Qwen3-VL shape on H200s and 80 GB GPUs."""

from __future__ import annotations

import dataclasses

import pytest

from rl_runtime import ParallelLayout, PreflightError, check_layout, choose_layout, estimate_memory
from rl_runtime.memory import GiB, ModelShape, TrainLayout, describe, flags
from trainers_fsdp import FsdpConfig
from trainers_megatron import MegatronConfig

QWEN3_VL_8B = ModelShape(8_190_735_360, 576_388_336, 4096, 12288, 36, 151936, 1152, 4304, 27)
H200 = 141 * GiB
MEGATRON, PLAIN, FSDP = MegatronConfig(), MegatronConfig(distributed_optimizer=False), FsdpConfig()


def layout(world: int, tokens: int, longest: int = 0, **parallel) -> TrainLayout:
    return TrainLayout(world, tokens, ParallelLayout(**parallel), longest)


def test_8b_at_tp1_is_refused_with_numbers_and_a_layout_that_fits():
    """The issue's arithmetic: with the optimizer state whole on every rank (the plain
    optimizer) ~160 GB of training state per GPU at TP=1, more than an H200."""
    tp1 = layout(8, 16384)
    with pytest.raises(PreflightError) as err:
        check_layout(QWEN3_VL_8B, PLAIN, tp1, H200, others=[FSDP], model="Qwen3-VL-8B-Instruct")
    message = err.value.message
    assert "Qwen3-VL-8B-Instruct (8.77B parameters) does not fit in 141.0 GiB" in message
    assert "megatron TP1" in message and "optimizer 98.0" in message
    assert "Try --backend megatron --tensor-parallel 2 --sequence-parallel" in message
    assert "--no-distributed-optimizer" in message  # the suggestion keeps the user's choice
    assert "or --backend fsdp" in message
    assert "\n" not in message
    chosen, estimate = choose_layout(QWEN3_VL_8B, PLAIN, tp1, H200)
    assert chosen.parallel == ParallelLayout(tp=2, sp=True, recompute="full")
    assert estimate.total <= H200 and check_layout(QWEN3_VL_8B, PLAIN, chosen, H200) == estimate


def test_suggestions_come_only_from_the_backends_offered():
    with pytest.raises(PreflightError) as err:
        check_layout(QWEN3_VL_8B, PLAIN, layout(8, 16384), H200)
    assert "--backend fsdp" not in err.value.message


def test_distributed_optimizer_lets_8b_train_without_tensor_parallelism():
    """The default: masters and moments sharded over 8 DP ranks (98 GiB -> 12 GiB), so TP=1
    with recomputation fits an H200, and an 80 GB GPU too."""
    tp1 = layout(8, 16384)
    with pytest.raises(PreflightError, match=r"optimizer 12\.2"):  # activations: recompute
        check_layout(QWEN3_VL_8B, MEGATRON, tp1, H200)
    for gpu in (H200, 80 * GiB):
        chosen, estimate = choose_layout(QWEN3_VL_8B, MEGATRON, tp1, gpu)
        assert chosen.parallel == ParallelLayout(tp=1, recompute="full")
        assert estimate.total <= gpu
        assert "distributed optimizer, recompute" in estimate.description


def test_80gb_gpus_get_the_recipes_tp4_layout():
    """On 80 GB GPUs, with the plain optimizer, the first megatron layout that fits is the miles
    recipe's for 8B."""
    chosen, _ = choose_layout(QWEN3_VL_8B, PLAIN, layout(8, 16384), 80 * GiB)
    assert chosen.parallel == ParallelLayout(tp=4, sp=True, recompute="full")


def test_fsdp_recomputes_and_never_gets_a_megatron_split():
    chosen, _ = choose_layout(QWEN3_VL_8B, FSDP, layout(8, 16384), 80 * GiB)
    assert chosen.parallel == ParallelLayout(recompute="full")


def test_nothing_fits_says_so():
    with pytest.raises(PreflightError, match="No layout on this many GPUs fits"):
        check_layout(QWEN3_VL_8B, FSDP, layout(1, 16384), 24 * GiB, others=[MEGATRON])


def test_context_parallel_is_chosen_for_long_samples_when_nothing_else_fits():
    """8B, 256K-token samples on 16 H200s: TP 8 with recomputation holds no whole sample,
    TP 8 x CP 2 does."""
    long = layout(16, 8192, 262144)
    tp8 = dataclasses.replace(long, parallel=ParallelLayout(tp=8, sp=True, recompute="full"))
    assert estimate_memory(QWEN3_VL_8B, MEGATRON, tp8).total > H200
    chosen, estimate = choose_layout(QWEN3_VL_8B, MEGATRON, long, H200)
    p = chosen.parallel
    assert p.cp > 1 and estimate.total <= H200
    assert chosen.world_size % (p.tp * p.cp) == 0
    assert "--context-parallel" in flags(MEGATRON, chosen)
    assert f"CP{p.cp}" in describe(MEGATRON, chosen)
    short = layout(8, 8192, 4096)
    assert choose_layout(QWEN3_VL_8B, MEGATRON, short, H200)[0].parallel.cp == 1


@pytest.mark.parametrize("trainer", [MEGATRON, FSDP], ids=["megatron", "fsdp"])
def test_8b_on_one_gpu_is_refused_before_loading_where_the_host_cannot_hold_its_part(trainer):
    """The plan keeps a node under 85 % of its memory. On one H200 with 128 GiB the trainer's
    state may take 83.8 GiB of it: 90 % of the optimizer on the host (88.9 GiB on either
    backend: float32 masters and moments, and the host step's pinned pieces) is refused before
    anything loads, with the fraction that fits; with 64 GiB no fraction fits both the GPU and
    the host, and the refusal names what to change instead."""
    from rl_runtime import ClusterConfig, ParallelConfig, plan_layout

    shape = dataclasses.asdict(QWEN3_VL_8B)
    one = ClusterConfig(num_gpus=1)
    kw = dict(trainer=dataclasses.replace(trainer, max_tokens_per_gpu=16384), shape=shape)
    kw |= dict(engines_park_weights=False, model_name="Qwen3-VL-8B")
    backend, given, fits = ("megatron", 0.9, 0.6) if trainer is MEGATRON else ("fsdp", 0.9, 0.5)
    parallel = ParallelConfig(
        gpu_memory_gib=140.4, host_memory_gib=128, optimizer_offload_fraction=given
    )
    with pytest.raises(PreflightError) as err:
        plan_layout(parallel, one, **kw)
    message = err.value.message
    assert f"optimizer {given:.0%} on the host" in message and "\n" not in message
    assert "beyond the 83.8 GiB each may take" in message and "85%" in message, message
    assert "(--host-memory-gib)" in message
    assert f"Try --backend {backend}" in message, message
    assert f"--optimizer-offload-fraction {fits:g} " in message, message
    fitting = dataclasses.replace(parallel, optimizer_offload_fraction=fits)
    settled, estimate = plan_layout(fitting, one, **kw)
    assert settled.offload_fraction == fits and estimate is not None
    assert estimate.host <= 83.8 * GiB
    small = dataclasses.replace(parallel, host_memory_gib=64, optimizer_offload_fraction=None)
    with pytest.raises(PreflightError) as err:
        plan_layout(small, one, **kw)
    message = err.value.message
    assert "of host memory per trainer rank" in message and "(--host-memory-gib)" in message
    assert "No --optimizer-offload-fraction fits both the GPU and the host" in message
    assert "use more GPUs (--num-gpus)" in message, message
