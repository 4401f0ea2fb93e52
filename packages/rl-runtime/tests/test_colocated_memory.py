"""A colocated GRPO step never asks one GPU for more memory than it has.

Trainer and engine share the device; the loop decides who holds what when. The real loop runs
here against groups that book their memory on one shared `Gpu` (GiB figures of the 2B shape on
an H200: after a Megatron train phase the trainer's allocator cached ~100 GiB of activations,
and the engine's weights and KV cache took ~30 GiB; before `release_cache` existed the engine's
`resume_memory` ran out of memory in the sync phase, as measured with
tools/bench/bench_grpo_e2e.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_runtime import CheckpointManager, GrpoLoopConfig, GrpoParts, RunLogger, run_grpo

CAPACITY, STATE, ACTIVATIONS, ENGINE = 139.0, 32.0, 100.0, 30.0


class Gpu:
    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.used: dict[str, float] = {}
        self.events: list[str] = []

    def book(self, who: str, gib: float, why: str) -> None:
        self.used[who] = gib
        self.events.append(f"{why}: {self.used}")
        total = sum(self.used.values())
        if total > self.capacity:
            raise MemoryError(f"{why}: {total} GiB of {self.capacity} GiB ({self.used})")


class Trainer:
    """The TrainGroup surface that `run_grpo` calls, with a caching allocator's behaviour."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu, self.on = gpu, True
        gpu.book("trainer", STATE, "trainer built")

    def _compute(self, why: str) -> None:
        assert self.on, f"{why} while offloaded"
        self.gpu.book("trainer", STATE + ACTIVATIONS, why)  # freed tensors stay cached

    def compute_logprobs(self, batch, *, reference=False):
        self._compute("logprobs")
        return [torch.zeros(len(ids)) for ids in batch.input_ids]

    def train_step(self, batch, *, loss="grpo"):
        self._compute("train")
        return {"loss": 0.0, "grad_norm": 1.0}

    def push_weights(self, rollout, bucket_bytes):
        assert self.on and "weights" not in rollout.released, "push without both sides' weights"
        rollout.weights_version += 1
        rollout.weights_valid = True

    def release_cache(self):
        self.gpu.book("trainer", STATE if self.on else 0.0, "release_cache")

    def offload(self):
        self.on = False
        self.gpu.book("trainer", 0.0, "offload")

    def onload(self):
        self.on = True
        self.gpu.book("trainer", STATE, "onload")

    def save_checkpoint(self, path):
        assert self.on
        (path / "state.txt").write_text("trainer")

    def load_checkpoint(self, path):
        raise AssertionError("not resumed in this test")


class Engine:
    """The RolloutGroup surface: generation needs its memory resumed. Weights and KV cache
    come back by parts, as SGLang's tags do; resuming a part not released fails, as SGLang's
    does. A release drops the weights' values: only a push makes them generate again (sglang
    0.5.23 keeps a host copy only with ``enable_weights_cpu_backup``,
    ``srt/model_executor/model_runner_components/load_model_utils.py``; the transformers
    engine without ``weights_backup`` refuses to generate until the push)."""

    def __init__(self, gpu: Gpu, weights: float = ENGINE, kv_cache: float = 0.0) -> None:
        self.gpu, self.weights_version = gpu, 0
        self.parts = {"weights": weights, "kv_cache": kv_cache}
        self.released: set[str] = set()
        self.weights_valid = True
        gpu.book("engine", weights + kv_cache, "engine built")

    @property
    def resumed(self) -> bool:
        return not self.released

    def generate(self, prompts, *, n, seed, **sampling):
        assert self.resumed, "generate after release_memory"
        assert self.weights_valid, "generate with weights dropped at release and not pushed"
        return [
            [
                SimpleNamespace(
                    token_ids=[5, 6, 7], logprobs=[-1.0] * 3, finish_reason="stop", error=None
                )
                for _ in range(n)
            ]
            for _ in prompts
        ]

    def release_memory(self):
        self.released = set(self.parts)
        self.weights_valid = False
        self.gpu.book("engine", 0.0, "release_memory")

    def resume_memory(self, tags=None):
        wanted = {t for t in (tags or self.parts) if t in self.parts}
        assert wanted <= self.released, f"resume of {wanted - self.released}: not released"
        self.released -= wanted
        held = sum(v for k, v in self.parts.items() if k not in self.released)
        self.gpu.book("engine", held, f"resume_memory {sorted(wanted)}")


class Prompts:
    def __len__(self) -> int:
        return 8

    def get(self, i):
        return SimpleNamespace(
            input_ids=[1, 2, 3, 4], pixel_values=None, image_grid_thw=None, answer=str(i)
        )

    @property
    def skipped(self) -> int:
        return 0

    @property
    def malformed_lines(self) -> int:
        return 0


def _parts(tmp_path, gpu: Gpu, engine: Engine | None = None) -> GrpoParts:
    calls = iter(range(1_000_000))
    return GrpoParts(
        train=Trainer(gpu),
        rollout=engine or Engine(gpu),
        train_prompts=Prompts(),
        decode=lambda ids: " ".join(map(str, ids)),
        # alternate 0 / 1 so each group has a learning signal and the train phase runs
        score=lambda texts, labels: [float(next(calls) % 2) for _ in texts],
        logger=RunLogger(tmp_path),
        checkpoints=CheckpointManager(tmp_path / "checkpoints"),
        offload_between_phases=True,
    )


def _small_run(**kw) -> GrpoLoopConfig:
    return GrpoLoopConfig(
        num_rollout=3,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        eval_interval=0,
        save_interval=2,
        **kw,
    )


def test_colocated_steps_fit_one_gpu(tmp_path):
    gpu = Gpu(CAPACITY)
    parts = _parts(tmp_path, gpu)
    rows = run_grpo(_small_run(), parts)
    assert len(rows) == 3
    # the first push, one per step, and one after each save (step 2 and the last), whose
    # release dropped the engine's weights
    assert parts.rollout.weights_version == 6
    # every sync found the trainer's cache released before the engine's weights came back
    resumes = [e for e in gpu.events if e.startswith("resume_memory ['weights']")]
    assert len(resumes) == 5
    assert all("'trainer': 32.0" in e for e in resumes), resumes


def test_the_gpu_double_refuses_what_does_not_fit(tmp_path):
    """The accounting catches the failure the loop avoids: the engine resuming while the
    trainer still caches a train phase's activations."""
    gpu = Gpu(CAPACITY)
    trainer, engine = Trainer(gpu), Engine(gpu)
    engine.release_memory()
    trainer.train_step(None)
    with pytest.raises(MemoryError, match="resume_memory"):
        engine.resume_memory()


def test_no_offload_train_keeps_the_state_on_the_gpu(tmp_path):
    """`--no-offload-train`: the trainer's state never moves (no onload / offload in the step),
    the engine still gives its memory back for the train phase and the cache is still
    released before it resumes."""
    gpu = Gpu(CAPACITY)
    parts = _parts(tmp_path, gpu)
    rows = run_grpo(_small_run(offload_train=False), parts)
    assert len(rows) == 3 and parts.train.on
    assert not [e for e in gpu.events if e.startswith(("offload", "onload"))]
    assert len([e for e in gpu.events if e.startswith("release_memory")]) == 3


def test_the_kv_cache_comes_back_after_the_trainer_state_left(tmp_path):
    """slime's order, for a trainer state and an engine that do not fit at once (SGLang's KV
    pool on the 35B-A3B preset: 32 + 8 + 100 = 140 GiB of 139). SGLang sizes its pool from the
    memory free at its start, so the engines start first and release before the trainers load
    (`engines_released`); the first push and every sync take the engine's weights back, and
    its KV cache only once the trainer's state has left the GPU."""
    gpu = Gpu(CAPACITY)
    engine = Engine(gpu, weights=8.0, kv_cache=100.0)
    engine.release_memory()
    parts = _parts(tmp_path, gpu, engine)  # the trainer loads beside the released engine
    parts.engines_released = True
    rows = run_grpo(_small_run(), parts)
    assert len(rows) == 3 and engine.weights_version == 6 and engine.resumed
    resumes = [e for e in gpu.events if e.startswith("resume_memory")]
    weights = [e for e in resumes if e.startswith("resume_memory ['weights']")]
    kv = [e for e in resumes if e.startswith("resume_memory ['kv_cache']")]
    assert len(weights) == len(kv) == 6  # the first push, one sync per step, two saves
    assert all("'trainer': 0.0" in e for e in kv), kv


class RecordingTrainer(Trainer):
    """Keeps each batch it trains on, and counts the log-prob forwards."""

    def __init__(self, gpu: Gpu) -> None:
        super().__init__(gpu)
        self.batches: list = []
        self.logprob_calls = 0

    def compute_logprobs(self, batch, *, reference=False):
        self.logprob_calls += 1
        return [torch.full((len(ids),), -2.0) for ids in batch.input_ids]

    def train_step(self, batch, *, loss="grpo"):
        self.batches.append(batch)
        return super().train_step(batch, loss=loss)


@pytest.mark.parametrize("use_rollout_logprobs", [False, True])
def test_use_rollout_logprobs_skips_the_old_logprob_forward(tmp_path, use_rollout_logprobs):
    """Off, the trainer recomputes the old log-probs (its -2.0); on, the engine's (-1.0 on the
    response, 0 on the prompt) are trained on and the trainer's forward never runs."""
    gpu = Gpu(CAPACITY)
    parts = _parts(tmp_path, gpu)
    parts.train = trainer = RecordingTrainer(gpu)
    run_grpo(_small_run(use_rollout_logprobs=use_rollout_logprobs), parts)
    assert trainer.batches
    assert trainer.logprob_calls == (0 if use_rollout_logprobs else len(trainer.batches))
    old = trainer.batches[0].old_logprobs[0]
    expected = [0.0] * 4 + [-1.0] * 3 if use_rollout_logprobs else [-2.0] * 7
    assert old.tolist() == expected


def test_use_rollout_logprobs_needs_the_engines_logprobs(tmp_path):
    """An engine that returns no log-probs cannot stand in for the trainer's: the run says which
    flag to drop instead of training on zeros."""

    class NoLogprobs(Engine):
        def generate(self, prompts, *, n, seed, **sampling):
            groups = super().generate(prompts, n=n, seed=seed, **sampling)
            for group in groups:
                for c in group:
                    c.logprobs = None
            return groups

    gpu = Gpu(CAPACITY)
    parts = _parts(tmp_path, gpu)
    parts.rollout = NoLogprobs(gpu)
    with pytest.raises(RuntimeError, match="--use-rollout-logprobs"):
        run_grpo(_small_run(use_rollout_logprobs=True), parts)


PUSH = 40.0  # the push's staging buffers, cached by the trainer's allocator after it


class PushingTrainer(Trainer):
    """A push leaves its buffers in the trainer's allocator cache until ``release_cache``."""

    def push_weights(self, rollout, bucket_bytes):
        super().push_weights(rollout, bucket_bytes)
        self.gpu.book("trainer", STATE + PUSH, "push")


@pytest.mark.parametrize("offload_train", [False, None], ids=["state-stays", "state-leaves"])
def test_the_push_buffers_are_released_before_the_kv_cache_resumes(tmp_path, offload_train):
    """The transformers engine's KV cache, sized by the colocation plan beside what the trainer
    keeps (its state, 32 GiB), comes back after every push only once the trainer has given
    back the push's buffers: push, release_cache, then the cache (32 + 40 of buffers + 8 + 90
    would be 170 GiB of 139). Where the state leaves, the offload comes between."""
    gpu = Gpu(CAPACITY)
    engine = Engine(gpu, weights=8.0, kv_cache=90.0)
    engine.release_memory()
    parts = _parts(tmp_path, gpu, engine)
    parts.train = PushingTrainer(gpu)
    parts.engines_released = True
    rows = run_grpo(_small_run(offload_train=offload_train), parts)
    # the first push (the loop's start), one sync per step, and where the state leaves, one
    # after each save (the engine made room for the state's return)
    pushes = 4 if offload_train is False else 6
    assert len(rows) == 3 and engine.weights_version == pushes and engine.resumed
    kinds = ("push", "release_cache", "offload", "resume_memory ['kv_cache']")
    order = [k for e in gpu.events for k in kinds if e.startswith(f"{k}:")]
    between = ["release_cache", "offload"] if offload_train is None else ["release_cache"]
    assert order.count("resume_memory ['kv_cache']") == pushes
    for i, kind in enumerate(order):
        if kind == "resume_memory ['kv_cache']":
            assert order[i - 1 - len(between) : i] == ["push", *between], order
    kv = [e for e in gpu.events if e.startswith("resume_memory ['kv_cache']")]
    stays = STATE if offload_train is False else 0.0
    assert all(f"'trainer': {stays}" in e for e in kv), kv
