"""The colocation plan's KV cache: beside what the trainer really keeps, in tokens.

On one H200 (139.8 GiB) the Qwen3.5-35B-A3B cut to 8 layers (8.19B parameters, 4,096 bytes of
keys and values a token, 12.4 MiB of gated-delta-net state a sequence) printed "trainer state
116.0 GiB, engine weights 15.3, its KV cache 1.3 GiB beside them for 0.7 needed (128 x 1408
tokens)" and its engine then held a 1-token cache. The plan counted the FSDP trainer's
gradients, which it frees before the engine resumes, gave the cache no size in tokens, and left
out the sequences' recurrent states, which come out of the same share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_runtime import ParallelLayout, StateBytes, estimate_memory
from rl_runtime.colocation import keep_train_state_on_gpu, plan_colocation
from rl_runtime.memory import GiB, ModelShape, TrainLayout

# rl_runtime.ModelShape(**vlm_models.sources.model_shape(...)) of that cut
QWEN35_CUT = ModelShape(
    language_params=7_745_820_672,
    vision_params=446_571_248,
    hidden_size=2048,
    intermediate_size=4608,
    num_layers=8,
    vocab_size=248_320,
    vision_hidden_size=1152,
    vision_intermediate_size=4304,
    vision_depth=27,
    expert_params=6_442_450_944,
    kv_bytes_per_token=4096,
)
PARAMS = QWEN35_CUT.language_params + QWEN35_CUT.vision_params
STATE_PER_SEQUENCE = 6 * (8192 * 4 * 2 + 4 * 32 * 128 * 128)  # 6 gated-delta-net layers
H200 = {"gpu_bytes": 139.8 * GiB, "tokens_per_sequence": 1408, "engine_share": 0.5}


@dataclass
class OneGpu:
    """A one-GPU backend of 20 bytes a parameter at its step's peak, ``fraction`` of the 12
    bytes of optimizer state on the host; between steps it keeps all of it (no
    ``resident_bytes``)."""

    fraction: float = 0.4

    def state_bytes(self, shape, layout, *, vision_patches_per_token=0.25) -> StateBytes:
        opt = 12 * PARAMS
        return StateBytes(2 * PARAMS, 6 * PARAMS, opt * (1 - self.fraction), 0, 0)

    def describe_layout(self, layout):
        return ["one GPU"]


@dataclass
class FreesGrads(OneGpu):
    """The same, keeping only weights and optimizer state between steps, as FSDP does."""

    def resident_bytes(self, shape, layout) -> float:
        return 2 * PARAMS + 12 * PARAMS * (1 - self.fraction)


def _estimate(backend: OneGpu):
    return estimate_memory(QWEN35_CUT, backend, TrainLayout(1, 16384, ParallelLayout()))


def test_the_h200_plan_names_its_cache_in_tokens_and_counts_the_recurrent_states():
    """The measured plan's numbers, now with the cache's tokens; with the 128 sequences'
    recurrent states (1.5 GiB) counted, the 1.3 GiB left beside 116 GiB of state hold no
    keys at all, so that plan would not keep the state on the GPU."""
    estimate = _estimate(OneGpu())
    keep, why = keep_train_state_on_gpu(QWEN35_CUT, estimate, engine_sequences=128, **H200)
    assert keep, why
    assert why.startswith("trainer state 116.0 GiB, engine weights 15.3, its KV cache 1.3 GiB (")
    assert "tokens) beside them for 0.7 needed (128 x 1408 = 180,224 tokens)" in why, why
    keep, why = keep_train_state_on_gpu(
        QWEN35_CUT,
        estimate,
        engine_sequences=128,
        state_bytes_per_sequence=STATE_PER_SEQUENCE,
        **H200,
    )
    assert not keep and "(0 tokens)" in why and "1.5 GiB of it recurrent states" in why, why


def test_the_cache_is_sized_beside_what_the_backend_keeps_between_steps():
    """A backend that frees its gradients before the engine resumes (FSDP) keeps 70.2 GiB of
    the cut's 116.0 during rollout: the cache beside it holds the rollout with its states, and
    the plan hands the engine that size in tokens."""
    estimate = _estimate(FreesGrads())
    assert round(estimate.resident / GiB, 1) == 70.2
    assert estimate.resident < estimate.weights + estimate.gradients + estimate.optimizer
    plan = plan_colocation(
        QWEN35_CUT,
        lambda f: _estimate(FreesGrads(f)),
        current=0.4,
        fractions=(),
        host_bytes=None,
        engine_sequences=128,
        state_bytes_per_sequence=STATE_PER_SEQUENCE,
        **H200,
    )
    assert not plan.offload_train and "trainer state 70.2 GiB" in plan.why, plan.why
    got = 0.5 * (139.8 * GiB - estimate.resident - 2 * PARAMS - 6 * GiB)
    assert plan.kv_cache_tokens == int((got - 128 * STATE_PER_SEQUENCE) // 4096)
    assert plan.kv_cache_tokens >= 128 * 1408
    assert f"({plan.kv_cache_tokens:,} tokens)" in plan.why


def test_an_offloaded_trainer_leaves_the_cache_the_whole_share():
    """Where the state leaves the GPU for each rollout, the planned tokens are those beside
    nothing of the trainer's."""
    big = dataclasses.replace(QWEN35_CUT, kv_bytes_per_token=4096 * 64)
    plan = plan_colocation(
        big,
        lambda f: _estimate(OneGpu(f)),
        current=0.4,
        fractions=(),
        host_bytes=None,
        engine_sequences=128,
        **H200,
    )
    assert plan.offload_train, plan.why
    got = 0.5 * (139.8 * GiB - 2 * PARAMS - 6 * GiB)
    assert plan.kv_cache_tokens == int(got // (4096 * 64))
