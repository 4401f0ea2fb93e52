"""rl_runtime.memory's part of the estimate, with made-up backends (the real backends'
arithmetic is tested in their packages, the two together in tests/test_layout_choice.py):
the reserve and total, the description and flags around the backend's words, which layouts
are tried in which order, and whether the train state stays on the GPU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from rl_runtime import (
    ParallelLayout,
    PreflightError,
    StateBytes,
    check_layout,
    choose_layout,
    estimate_memory,
)
from rl_runtime.colocation import keep_train_state_on_gpu, plan_colocation
from rl_runtime.memory import (
    HOST_CAP,
    HOST_RESERVE_BYTES,
    PROCESS_HOST_BYTES,
    RESERVE_BYTES,
    GiB,
    MemoryEstimate,
    ModelShape,
    TrainLayout,
    candidate_layouts,
    flags,
)


@dataclass
class Split:
    """A backend whose state splits by TP and whose activations recompute to a tenth."""

    name: str
    gib: float  # state per GPU at TP1
    max_tokens_per_gpu: int = 4096

    def supports(self, layout: ParallelLayout, world_size: int | None = None) -> str | None:
        return None

    def state_bytes(self, shape, layout, *, vision_patches_per_token=0.25) -> StateBytes:
        acts = 10 * GiB * layout.tokens_per_gpu / 4096 / (10 if layout.recomputes else 1)
        return StateBytes(self.gib * GiB / layout.parallel.tp, 0, 0, acts, 0)

    def describe_layout(self, layout):
        return [f"{self.name} TP{layout.parallel.tp}"]

    def layout_flags(self, layout):
        return [f"--backend {self.name}", f"--tensor-parallel {layout.parallel.tp}"]


@dataclass
class Whole(Split):
    """A backend that runs no split (as FSDP)."""

    def supports(self, layout: ParallelLayout, world_size: int | None = None) -> str | None:
        return None if layout.tp == layout.cp == 1 else "--tensor-parallel is not for whole"

    def layout_flags(self, layout):
        return [f"--backend {self.name}"]


SHAPE = ModelShape(1, 1, 1, 1, 1, 1)


def layout(world: int = 8, tokens: int = 4096, longest: int = 0, **parallel) -> TrainLayout:
    return TrainLayout(world, tokens, ParallelLayout(**parallel), longest)


def test_the_estimate_is_the_backends_parts_and_a_reserve():
    estimate = estimate_memory(SHAPE, Split("a", 40), layout(longest=8192, recompute="full"))
    assert estimate.weights == 40 * GiB and estimate.activations == 2 * GiB
    assert estimate.total == 42 * GiB + RESERVE_BYTES
    assert estimate.description == (
        "a TP1, recompute, 4096 tokens per micro-batch (8192 per GPU for the longest sample)"
    )
    assert flags(Split("a", 40), layout(recompute="full")) == (
        "--backend a --tensor-parallel 1 --gradient-checkpointing --max-tokens-per-gpu 4096"
    )
    assert estimate.to_dict(100 * GiB)["fits"] is True


def test_candidates_try_the_backend_then_the_others_then_fewer_tokens():
    """Each backend's variants are those it supports: the whole backend gets recompute only;
    CP only for a sample beyond the budget."""
    split, whole = Split("a", 40), Whole("b", 40)
    found = candidate_layouts(split, layout(), [whole])
    backends = [c for c, _ in found]
    assert backends.index(whole) > max(i for i, c in enumerate(backends[:8]) if c is split)
    assert [(t.parallel.tp, t.parallel.recompute) for c, t in found[:7]] == [
        (1, "full"), (2, "none"), (2, "full"), (4, "none"), (4, "full"), (8, "none"), (8, "full"),
    ]  # fmt: skip
    on_gpu = [(c, t) for c, t in found if t.parallel.optimizer_offload == 0]
    assert [t.parallel for c, t in on_gpu if c is whole and t.max_tokens_per_gpu == 4096] == [
        ParallelLayout(),
        ParallelLayout(recompute="full"),
    ]
    # then the same with the optimizer on the host, the smallest part first, before fewer tokens
    offloaded = [t.parallel.optimizer_offload for _, t in found if t.max_tokens_per_gpu == 4096]
    assert offloaded == sorted(offloaded) and offloaded[-1] == 1.0
    assert {t.parallel.cp for _, t in found} == {1}
    assert {t.max_tokens_per_gpu for _, t in found} == {4096, 2048, 1024}
    assert max(t.parallel.cp for _, t in candidate_layouts(split, layout(longest=65536))) == 8


def test_choose_keeps_the_backend_and_check_suggests_each_backend():
    split, whole = Split("a", 100), Whole("b", 20)
    chosen, estimate = choose_layout(SHAPE, split, layout(), 60 * GiB)
    # TP1: 100 + 10 + 3 GiB, TP1 recompute: 104, TP2: 63, TP2 recompute: 54
    assert chosen.parallel == ParallelLayout(tp=2, sp=True, recompute="full")
    assert estimate.total <= 60 * GiB
    with pytest.raises(PreflightError) as err:
        check_layout(SHAPE, split, layout(), 60 * GiB, others=[whole], model="m")
    message = err.value.message
    assert message.startswith("m (0.00B parameters) does not fit in 60.0 GiB per GPU as a TP1")
    assert "Try --backend a --tensor-parallel 2" in message
    assert "or --backend b --max-tokens-per-gpu 4096 (about 33.0 GiB)" in message


def test_nothing_fits_says_so():
    with pytest.raises(PreflightError, match="No layout on this many GPUs fits"):
        check_layout(SHAPE, Whole("b", 100), layout(), 60 * GiB, others=[Whole("c", 90)])


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
    params = shape.language_params + shape.vision_params
    state = StateBytes(2 * params, 6 * params, 12 * params, 0, 0)
    estimate = estimate_memory(shape, Whole("b", 0), layout(1, 16384))
    estimate = type(estimate)(estimate.description, **vars(state))
    kw = {"gpu_bytes": 141 * GiB, "tokens_per_sequence": 1408, "engine_share": 0.5}
    keep, why = keep_train_state_on_gpu(shape, estimate, engine_sequences=128, **kw)
    assert keep and "trainer state 39.1 GiB" in why, why
    assert not keep_train_state_on_gpu(shape, estimate, engine_sequences=512, **kw)[0]
    unknown = _shape(0)
    assert not keep_train_state_on_gpu(unknown, estimate, engine_sequences=1, **kw)[0]


@dataclass
class Offloading(Whole):
    """A backend whose ``optimizer`` GiB move to the host by the layout's offload fraction."""

    optimizer: float = 0.0

    def state_bytes(self, shape, layout, *, vision_patches_per_token=0.25) -> StateBytes:
        host = self.optimizer * GiB * layout.parallel.optimizer_offload
        return StateBytes(self.gib * GiB, 0, self.optimizer * GiB - host, 0, 0, host)


def test_the_optimizer_goes_to_the_host_only_when_the_gpu_cannot_hold_it():
    """The smallest tenth of the optimizer on the host that fits the GPU, within the host
    budget; none where the GPU holds it all; refused, naming the host, where the host cannot
    hold what the GPU cannot."""
    backend = Offloading("b", 40, optimizer=50)  # 40 + 50 + 3 GiB on the GPU without offload
    kw = dict(offloads=(0.1, 0.2, 0.5, 1.0), host_bytes=100 * GiB)
    chosen, estimate = choose_layout(SHAPE, backend, layout(1), 85 * GiB, **kw)
    assert chosen.parallel.optimizer_offload == 0.2  # 0.1 leaves 88 GiB on the GPU, 0.2 83
    assert estimate.total == 83 * GiB and estimate.host == 10 * GiB
    assert "optimizer 20% on the host" in estimate.description
    assert "--optimizer-cpu-offload --optimizer-offload-fraction 0.2" in flags(backend, chosen)
    assert estimate.to_dict(85 * GiB, 100 * GiB)["host_gib"] == 10.0
    assert choose_layout(SHAPE, backend, layout(1), 100 * GiB, **kw)[0] == layout(1)
    short = dict(kw, host_bytes=5 * GiB)
    # nothing fits: the first that fits the GPU, whose host part check_layout refuses
    gpu_only, _ = choose_layout(SHAPE, backend, layout(1), 85 * GiB, **short)
    offloaded = layout(1, optimizer_offload=0.2)
    assert gpu_only == offloaded
    with pytest.raises(PreflightError, match=r"about 10\.0 GiB of host memory per trainer rank"):
        check_layout(SHAPE, backend, offloaded, 85 * GiB, host_bytes=5 * GiB)
    with pytest.raises(PreflightError) as err:
        check_layout(SHAPE, backend, layout(1), 85 * GiB, host_bytes=100 * GiB)
    assert "Try --backend b --optimizer-cpu-offload --optimizer-offload-fraction 0.2" in (
        err.value.message
    )


def test_colocation_moves_optimizer_to_the_host_when_the_host_cannot_take_the_state():
    """An 8B-like model (20 bytes a parameter) on a 140 GiB GPU: its state stays when the cache
    fits beside it; offloaded where its host copies fit; where they do not, it stays and the
    first larger optimizer fraction that gives the cache room is taken, else the largest the
    host holds (the cache then runs the rollout in turns)."""
    shape = dataclasses.replace(
        _shape(147_456), language_params=8_200_000_000, vision_params=600_000_000
    )
    params = 8.8e9

    def estimate_at(f: float) -> MemoryEstimate:
        opt = 12 * params
        return MemoryEstimate("x", 2 * params, 6 * params, opt * (1 - f), 0, 0, host=opt * f)

    kw = {"gpu_bytes": 140 * GiB, "tokens_per_sequence": 1408, "engine_share": 0.5}
    fractions = [round(0.1 * i, 1) for i in range(1, 11)]
    small = plan_colocation(
        shape, estimate_at, current=0.5, fractions=fractions, host_bytes=400 * GiB,
        engine_sequences=128, **kw,
    )  # fmt: skip
    assert (small.optimizer_offload, small.offload_train) == (0.5, True), small.why
    few = plan_colocation(
        shape, estimate_at, current=0.5, fractions=fractions, host_bytes=120 * GiB,
        engine_sequences=64, **kw,
    )  # fmt: skip
    assert not few.offload_train and few.optimizer_offload == 0.8, few.why
    assert keep_train_state_on_gpu(shape, estimate_at(0.8), engine_sequences=64, **kw)[0]
    assert not keep_train_state_on_gpu(shape, estimate_at(0.7), engine_sequences=64, **kw)[0]
    turns = plan_colocation(
        shape, estimate_at, current=0.5, fractions=fractions, host_bytes=92 * GiB,
        engine_sequences=128, **kw,
    )  # fmt: skip
    assert not turns.offload_train and turns.optimizer_offload == 0.9, turns.why
    assert "in turns" in turns.why and "163.9 GiB" in turns.why, turns.why
    given = plan_colocation(
        shape, estimate_at, current=0.5, fractions=(), host_bytes=92 * GiB,
        engine_sequences=128, **kw,
    )  # fmt: skip
    assert (given.optimizer_offload, given.offload_train) == (0.5, False), given.why


def test_colocation_keeps_the_fraction_where_the_backend_does_not_offload():
    """A backend that holds the optimizer on the GPU in this layout (sharded FSDP counts no
    host part) is never given a fraction it would refuse at build."""
    shape = dataclasses.replace(
        _shape(147_456), language_params=8_200_000_000, vision_params=600_000_000
    )
    params = 8.8e9

    def on_gpu(f: float) -> MemoryEstimate:
        return MemoryEstimate("x", 2 * params, 6 * params, 12 * params, 0, 0)

    plan = plan_colocation(
        shape, on_gpu, current=0.0, fractions=[0.5, 1.0], gpu_bytes=400 * GiB,
        host_bytes=92 * GiB, engine_sequences=2048, tokens_per_sequence=1408, engine_share=0.5,
    )  # fmt: skip
    assert (plan.optimizer_offload, plan.offload_train) == (0.0, False), plan.why


def test_host_budget_keeps_the_node_peak_under_85_percent_of_its_memory():
    """Ray's memory monitor kills a worker past 95 % of the node; the plan keeps the node's peak
    (the launcher and Ray, every trainer rank's and engine's runtime, the weights engines park,
    each rank's state at its budget) at 85 %, colocated or not, parked or dropped, and the
    budget is what is left: 128 GiB and one GPU leave 83.8 GiB to the trainer's state."""
    from rl_runtime import ClusterConfig, ParallelConfig, host_budget
    from rl_runtime.parallel import node_host_plan

    shape = dataclasses.replace(
        _shape(147_456), language_params=8_200_000_000, vision_params=600_000_000
    )
    parallel = ParallelConfig(host_memory_gib=128)
    for cluster in (ClusterConfig(num_gpus=1), ClusterConfig(num_gpus=4, colocate=False)):
        for park in (True, False):
            plan = node_host_plan(
                parallel, cluster, shape, with_engines=True, engines_park_weights=park
            )
            assert plan is not None and plan.engines >= 1
            peak = plan.reserve + plan.processes + plan.parked + plan.trainers * plan.per_rank
            assert peak == pytest.approx(HOST_CAP * 128 * GiB) and HOST_CAP == 0.85
            budget = host_budget(
                parallel, cluster, shape, with_engines=True, engines_park_weights=park
            )
            assert budget == plan.per_rank
    one = ClusterConfig(num_gpus=1)
    dropped = host_budget(parallel, one, shape, with_engines=True, engines_park_weights=False)
    parked = host_budget(parallel, one, shape, with_engines=True)
    assert dropped == pytest.approx(0.85 * 128 * GiB - HOST_RESERVE_BYTES - 2 * PROCESS_HOST_BYTES)
    assert dropped / GiB == pytest.approx(83.8)
    assert dropped - parked == pytest.approx(2 * 8.8e9)
    # an SFT run has no engines: one process fewer
    alone = host_budget(parallel, one, shape, with_engines=False)
    assert alone == pytest.approx(dropped + PROCESS_HOST_BYTES)
