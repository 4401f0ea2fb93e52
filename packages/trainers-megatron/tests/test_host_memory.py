"""The Megatron backend's host-memory estimate against the resident memory the actor really adds.

On a GPU the plan holds a node's peak under its cap by the estimate of what each trainer rank
keeps on the host (``trainers_megatron.memory.host_bytes``): megatron-core's
HybridDeviceOptimizer's float32 masters and moments and its host step's pieces. On the CPU every byte of
the state is host memory (``vlm_models.megatron._cpu_compat``: the CPU plays the device, the
hybrid optimizer's host half stepped apart as on a GPU), so building the actor with half of
its optimizer on the host and taking two steps measures the whole estimate: the resident set
after the steps (C heap trimmed) less the one before building, in a process of its own.
Automatic garbage collection is off from the build on, as in a trainer process
(``rl_runtime.gc_policy``): what start-up leaves in reference cycles (megatron-core's first
hybrid optimizer, over the whole model) stays counted.

The model is Qwen3-VL-2B's shape (hidden 2048, MLP 6144, 16 / 8 heads, its vision tower's
1024-wide blocks) cut to one decoder layer, one vision block without deepstack mergers and a
16,384-token vocabulary: 126M parameters, about 2.5 GB of state, well above the few hundred MB
torch, megatron-core and the interpreter hold, and within a few GB of peak memory.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos.run_context import ModelShape, ParallelLayout, TrainLayout

FRACTION = 0.5  # of the optimizer on the host
TOKENS = 96  # per micro-batch
CUT = dict(
    num_hidden_layers=1,
    vocab_size=16384,
    image_token_id=16000,
    video_token_id=16001,
    vision_start_token_id=16002,
    vision_end_token_id=16003,
    bos_token_id=16004,
    eos_token_id=16005,
)
CUT["vision_config.depth"] = 1
CUT["vision_config.deepstack_visual_indexes"] = []


def measure() -> dict[str, float]:
    """In a fresh process: the resident bytes the actor adds by two steps, and its counts."""
    from vlm_models.megatron import _cpu_compat

    _cpu_compat.apply()
    from rl_algos.optimizer import OptimConfig
    from trainer_core.startup import resident_gib, trim_host_heap
    from trainers_fsdp.synthetic import synthetic_batch
    from trainers_megatron import MegatronConfig
    from trainers_megatron.actor import MegatronActor
    from trainers_megatron.optim import hybrid_optimizer, optimizers
    from vlm_models.presets import preset_config

    def resident() -> float:
        trim_host_heap()
        gib = resident_gib()
        assert gib is not None
        return gib * 2**30

    config = preset_config("qwen3-vl-2b", **CUT)
    batch = synthetic_batch(config, [64, 48, 40], image_patches=[(4, 4), None, (4, 4)])
    before = resident()
    actor = MegatronActor(
        MegatronConfig(
            model="qwen3-vl-2b",
            model_overrides=CUT,
            param_dtype="bfloat16",
            max_tokens_per_gpu=TOKENS,
            optimizer_offload=FRACTION,
            optim=OptimConfig(lr=1e-4),
            seed=0,
        )
    )
    gc.disable()  # as a trainer process once built
    batch.old_logprobs = actor.compute_logprobs(batch)
    metrics = [actor.train_step(batch, loss="grpo") for _ in range(2)]
    grown = resident() - before
    [hybrid] = [hybrid_optimizer(opt) for opt in optimizers(actor.optimizer)]
    return {
        "grown": grown,
        "micro_batches": metrics[-1]["num_micro_batches"],
        "offloaded": sum(p.numel() for p in hybrid.cpu_copys_map_gpu_param),
        "params": sum(p.numel() for g in hybrid.param_groups for p in g["params"]),
    }


def shape() -> ModelShape:
    from vlm_models.presets import preset_config
    from vlm_models.sources import model_shape

    return ModelShape(**model_shape(preset_config("qwen3-vl-2b", **CUT)))


def layout() -> TrainLayout:
    return TrainLayout(1, TOKENS, ParallelLayout(optimizer_offload=FRACTION))


@pytest.mark.slow
def test_the_host_estimate_is_within_10_percent_of_the_resident_memory_measured():
    from trainers_megatron.memory import host_bytes

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    model = shape()
    params = model.language_params + model.vision_params
    assert got["params"] == params and got["micro_batches"] >= 2
    assert FRACTION * params <= got["offloaded"] < params  # part of it on the host
    estimate = host_bytes(model, layout(), distributed_optimizer=True, on_cpu=True)
    assert got["grown"] > 2e9  # the state dominates what the process holds besides
    assert abs(estimate - got["grown"]) <= 0.1 * got["grown"], (estimate, got["grown"])
    # on a GPU the host keeps the offloaded masters and moments and the host step's pinned
    # pieces (two float32 gradient and two bf16 weight buffers, each rounded up to 2^26
    # elements here); megatron-core's own step a float32 gradient copy instead of the pieces
    gpu = host_bytes(model, layout(), distributed_optimizer=True)
    assert gpu == pytest.approx(12 * FRACTION * params + 2 * (4 + 2) * 2**26)
    own = host_bytes(model, layout(), distributed_optimizer=True, pieces=False)
    assert own == pytest.approx(16 * FRACTION * params)


if __name__ == "__main__":  # the measurement, and the estimate beside it (the report's command)
    from trainers_megatron.memory import host_bytes

    out = measure()
    out["estimate"] = host_bytes(shape(), layout(), distributed_optimizer=True, on_cpu=True)
    out["off_by"] = out["estimate"] / out["grown"] - 1
    print(json.dumps(out))
