"""Faults a long GRPO run meets, on CPU with real Ray actors, the real FSDP trainer, the real
transformers engine and real processes that really die (`os._exit` inside the actor).

- a rollout engine dies mid-rollout: it is restarted, re-synced and the rollout repeated, and
  the run ends exactly as an uninterrupted one; with no retries left the run stops with one
  line, its checkpoint intact, and `resume` continues exactly;
- a trainer rank dies: the run stops (no hang in the collective its peer waits in) naming the
  rank, the checkpoint intact;
- a non-finite loss: the update is skipped and counted; N steps in a row stop the run;
- the disk fills during a save: the partial save is removed, the previous checkpoint is used;
- the engine's weights go stale (pushes stop landing): the log-prob gap between engine and
  trainer leaves the float32 band and the run stops with one line;
- the engine's KV cache shrinks below what the requests need: the run stops before the update
  with one line naming the figures, the settings and the checkpoint.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import ray

from rl_runtime import (
    CheckpointManager,
    GrpoLoopConfig,
    GrpoParts,
    RolloutGroup,
    RunLogger,
    TrainGroup,
    create_placement,
    init_ray,
    read_metrics,
    run_grpo,
)
from rl_runtime.faults import (
    CheckpointFailed,
    LogprobMismatch,
    NonFiniteStop,
    RolloutFailed,
    RunStopped,
    WorkerDied,
)
from rl_runtime.logprob_guard import GAP_METRIC, band_of

# Real processes on 2 shared cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROLLOUT_SEED = 1234
LOOP = dict(
    num_rollout=3,
    rollout_batch_size=4,
    n_samples_per_prompt=2,
    global_batch_size=8,
    rollout_temperature=1.0,
    rollout_max_response_len=4,
    eval_interval=0,
    save_interval=1,
    keep_checkpoints=5,
    weight_bucket_mb=1,
    rollout_seed=ROLLOUT_SEED,
)


def _step_seed(step: int) -> int:
    """The sampling seed the loop gives engine 0 at `step`."""
    return ROLLOUT_SEED * 1_000_003 + step


# ------------------------------------------------------------------ what runs in the actors


def _tiny():
    from vlm_data.processor import tiny_processor
    from vlm_models.presets import tiny_config

    proc = tiny_processor()
    tok = proc.tokenizer
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    cfg = tiny_config(
        vocab_size=len(tok),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return proc, cfg


class FaultyTrainer:
    """The real FSDP actor, with a fault from its `at`-th call on (in this rank's process,
    while the `trigger` file exists): "die" exits the process in `train_step`, "nan" makes the
    loss NaN from then on (NaN advantages), "enospc" runs out of disk part-way through a save."""

    def __init__(
        self, cfg, fault: str | None, rank: int, at: int, trigger: str, export_dtype: str
    ) -> None:
        from rl_algos import GrpoLossConfig
        from trainers_fsdp import FsdpConfig, OptimConfig
        from trainers_fsdp.actor import FsdpActor

        self.actor = FsdpActor(
            FsdpConfig(
                model=cfg,
                device="cpu",
                attn_implementation="sdpa",
                seed=0,
                optim=OptimConfig(lr=1e-3),
                grpo=GrpoLossConfig(),
                export_dtype=export_dtype,  # the weights' dtype on the wire to the engine
            )
        )
        self.fault, self.at, self.trigger = fault, at, Path(trigger)
        self.armed = int(os.environ.get("RANK", "0")) == rank
        self.calls = {"train_step": 0, "save_checkpoint": 0}

    def __getattr__(self, name):
        return getattr(self.actor, name)

    def _due(self, method: str, fault: str) -> bool:
        self.calls[method] += 1
        armed = self.fault == fault and self.armed and self.trigger.exists()
        return armed and self.calls[method] == self.at

    def train_step(self, batch, *, loss="grpo"):
        if self._due("train_step", "die"):
            os._exit(1)
        if self.fault == "nan" and self.armed and self.calls["train_step"] >= self.at:
            nan = float("nan")
            batch = dataclasses.replace(batch, advantages=[a * nan for a in batch.advantages])
        return self.actor.train_step(batch, loss=loss)

    def save_checkpoint(self, path):
        if self._due("save_checkpoint", "enospc"):
            shard = Path(path) / "__0_0.distcp"
            with open(shard, "wb") as f:
                f.write(b"\0" * 4096)  # the disk fills part-way through the first shard
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))
        self.actor.save_checkpoint(path)


class DyingEngine:
    """The real transformers engine; its process exits in `generate` when asked for
    `die_seed` while the `trigger` file exists (`once`: the file is removed first, so the
    restarted engine lives), or, with `die_in_sync`, in the first weight update after a
    rollout. With `pushes` set it applies only that many weight updates and drops the rest
    unread (a sync that silently never lands: stale weights)."""

    def __init__(
        self, engine, die_seed, trigger: str, once: bool, die_in_sync: bool, pushes=None
    ) -> None:
        self.engine, self.die_seed, self.trigger, self.once = engine, die_seed, Path(trigger), once
        self.die_in_sync, self.generated, self.pushes = die_in_sync, False, pushes

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, params):
        if params.seed == self.die_seed and self.trigger.exists():
            if self.once:
                self.trigger.unlink()
            os._exit(1)
        self.generated = True
        return self.engine.generate(requests, params)

    def update_weights(self, buckets):
        if self.die_in_sync and self.generated and self.trigger.exists():
            if self.once:
                self.trigger.unlink()
            os._exit(1)
        if self.pushes is not None:
            self.pushes -= 1
            if self.pushes < 0:
                for _ in buckets:  # received, never loaded
                    pass
                return None
        return self.engine.update_weights(buckets)


class ShrinkingCache:
    """The real transformers engine whose KV cache is taken again with `tokens` tokens from
    the rollout asked for `seed` on, as a colocated engine's is when the trainer's state
    keeps the GPU memory the first rollout had (the cache is sized at each rollout from what
    is free then)."""

    def __init__(self, engine, seed: int, tokens: int) -> None:
        self.engine, self.seed, self.tokens = engine, seed, tokens

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, params):
        if params.seed == self.seed:
            self.engine.release_memory()
            self.engine.resume_memory()
            self.engine._cache_tokens = self.tokens  # taken anew at this generate
            self.engine.cache = self.engine.runner = None
        return self.engine.generate(requests, params)


def make_trainer(cfg, fault=None, rank=0, at=0, trigger="/nonexistent", export_dtype="bfloat16"):
    return FaultyTrainer(cfg, fault, rank, at, trigger, export_dtype)


def make_engine(
    cfg,
    eos,
    die_seed=None,
    trigger="/nonexistent",
    once=True,
    die_in_sync=False,
    pushes=None,
    shrink=None,
):
    import torch

    from rollout_sglang.hf.engine import HFEngine
    from vlm_models.build import build_model

    torch.manual_seed(0)
    engine = HFEngine(build_model(cfg), device="cpu", eos_token_ids=eos, max_batch_size=8)
    if shrink is not None:  # (seed, tokens): `ShrinkingCache`
        engine = ShrinkingCache(engine, *shrink)
    return DyingEngine(engine, die_seed, trigger, once, die_in_sync, pushes)


# ------------------------------------------------------------------------ the driver side


class Prompts:
    """A `PromptSource` over prompts built once."""

    def __init__(self, prompts) -> None:
        self.prompts = prompts
        self.skipped = self.malformed_lines = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def get(self, index: int):
        return self.prompts[index]


@pytest.fixture(scope="module")
def tiny():
    from vlm_data.prompts import PromptBuilder
    from vlm_data.synthetic import make_synthetic_rows

    proc, cfg = _tiny()
    builder = PromptBuilder(proc, template="none")
    prompts = [builder.build(r, i) for i, r in enumerate(make_synthetic_rows(16, task="color"))]
    eos = [proc.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    init_ray(num_cpus=2)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield proc, cfg, Prompts(prompts), eos
    ray.shutdown()


def _color_reward(texts, answers):
    return [float(a.lower() in t.lower()) for t, a in zip(texts, answers, strict=True)]


def run(
    tiny,
    run_dir: Path,
    *,
    trainer=None,
    engine=None,
    world_size=1,
    score=_color_reward,
    resume=False,
    compute_dtype="bfloat16",
    **loop,
):
    """One GRPO run of the tiny model with fresh actors; returns the logged rows."""
    from rollout_sglang.types import GenerateRequest, SamplingParams

    proc, cfg, prompts, eos = tiny
    placement = create_placement(
        num_trainers=world_size, num_engines=1, colocate=True, use_gpu=False, cpus_per_bundle=0.4
    )
    groups = []
    try:
        train = TrainGroup(  # the ranks start while the engine starts, as in the launcher
            functools.partial(make_trainer, cfg, **(trainer or {})),
            world_size=world_size,
            placement=placement,
            num_cpus=0.2,
            wait=False,
        )
        groups.append(train)
        rollout = RolloutGroup(
            functools.partial(make_engine, cfg, eos, **(engine or {})),
            num_engines=1,
            placement=placement,
            request_fn=GenerateRequest.from_prompt,
            params_fn=SamplingParams,
            num_cpus=0.2,
        )
        groups.append(rollout)
        train.ready()
        checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=5)
        latest = checkpoints.latest() if resume else None
        parts = GrpoParts(
            train=train,
            rollout=rollout,
            train_prompts=prompts,
            decode=functools.partial(proc.tokenizer.decode, skip_special_tokens=True),
            score=score,
            logger=RunLogger(run_dir, resume_step=latest[0] if latest else None),
            checkpoints=checkpoints,
            resume=resume,
            compute_dtype=compute_dtype,
        )
        return run_grpo(GrpoLoopConfig(**(LOOP | loop)), parts)
    finally:
        for g in groups:
            g.shutdown()
        placement.remove()


def _same(rows_a, rows_b) -> bool:
    """Per-step metrics equal, except timings and the restart count."""

    def keep(row):
        return {
            k: v
            for k, v in row.items()
            if not (
                k.startswith(("time_", "perf/")) or k.endswith(("_per_s", "time_s", "restarts"))
            )
        }

    return [keep(r) for r in rows_a] == [keep(r) for r in rows_b]


def _steps(run_dir: Path) -> list[int]:
    return [s for s, _ in CheckpointManager(run_dir / "checkpoints").complete()]


# ---------------------------------------------------------------------------------- tests


def test_dead_engine_is_restarted_or_the_run_stops_and_resumes_exactly(tiny, tmp_path):
    # Dies at every attempt of step 2 with one retry allowed: stops, step 1's checkpoint kept.
    trigger = tmp_path / "die_always"
    trigger.touch()
    engine = dict(die_seed=_step_seed(2), trigger=str(trigger), once=False)
    stopped = tmp_path / "stopped"
    with pytest.raises(RunStopped) as err:
        run(tiny, stopped, engine=engine, max_rollout_retries=1)
    message = str(err.value)
    assert "rollout engine 0 died during generate" in message and "\n" not in message
    assert "gave up after 1 restart" in message and "step_000001" in message
    assert _steps(stopped) == [1]
    # --resume from it (the engine healthy again) continues exactly: step 1 of the first
    # run, steps 2 and 3 of this one, are the uninterrupted run (test_e2e_geo3k holds resume
    # exact after a SIGKILL).
    uninterrupted = run(tiny, stopped, resume=True)

    # Dies once in step 2's rollout: restarted, re-synced, the rollout repeated; same run.
    trigger = tmp_path / "die_once"
    trigger.touch()
    engine = dict(die_seed=_step_seed(2), trigger=str(trigger), once=True)
    retried = run(tiny, tmp_path / "retried", engine=engine)
    assert not trigger.exists()  # it really died
    assert [r["engine_restarts"] for r in retried] == [0, 1, 1]
    assert _same(retried, uninterrupted)


def test_engine_dying_during_the_weight_sync_is_restarted(tiny, tmp_path):
    """The engine's process exits inside the weight update after step 1's rollout (the kill
    lands in the sync by construction): it is restarted, given the trainer's weights, and the
    run ends with the metrics of a run that was never interrupted. With no retry allowed the
    run stops with one line that names the push and does not blame the trainer rank."""
    uninterrupted = run(tiny, tmp_path / "plain", num_rollout=2)
    trigger = tmp_path / "die"
    trigger.touch()
    engine = dict(trigger=str(trigger), die_in_sync=True, once=True)
    retried = run(tiny, tmp_path / "retried", engine=engine, num_rollout=2)
    assert not trigger.exists()  # it really died
    assert [r["engine_restarts"] for r in retried] == [1, 1]
    assert _same(retried, uninterrupted)

    trigger.touch()
    with pytest.raises(RunStopped) as err:
        run(tiny, tmp_path / "run", engine=engine, num_rollout=1, max_rollout_retries=0)
    message = str(err.value)
    assert message.startswith("trainer rank 0 failed during push_weights: an actor it called")
    assert "gave up after 0 restart(s)" in message and "\n" not in message
    assert not isinstance(err.value, WorkerDied)


def test_dead_trainer_rank_stops_the_run_naming_it(tiny, tmp_path):
    trigger = tmp_path / "die"
    trigger.touch()
    out = tmp_path / "run"
    trainer = dict(fault="die", rank=1, at=2, trigger=str(trigger))
    # Rank 0 is left inside a gloo collective that rank 1 never joins; the run must not wait
    # for it (the suite's timeout would catch a hang).
    with pytest.raises(WorkerDied) as err:
        run(tiny, out, trainer=trainer, world_size=2)
    message = str(err.value)
    assert message.startswith("trainer rank 1 died during train_step"), message
    assert "rank 0" not in message and "step_000001 is intact" in message
    assert _steps(out) == [1]
    assert len(read_metrics(out / "metrics.jsonl")) == 1  # step 1's row, nothing lost


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tiny, tmp_path):
    trigger = tmp_path / "nan"
    trigger.touch()
    out = tmp_path / "run"
    trainer = dict(fault="nan", rank=0, at=2, trigger=str(trigger))  # NaN loss from step 2 on
    with pytest.raises(NonFiniteStop) as err:
        run(tiny, out, trainer=trainer, num_rollout=5, max_nonfinite_steps=2)
    assert "2 steps in a row had a non-finite loss or gradient" in str(err.value)
    assert "step_000002 is intact" in str(err.value)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["nonfinite_updates"] for r in rows] == [0, 1, 1]
    assert [r["nonfinite_steps_in_row"] for r in rows] == [0, 1, 2]
    assert [r["update_skipped"] for r in rows] == [0.0, 1.0, 1.0]
    assert math.isfinite(rows[0]["grad_norm"]) and rows[1]["grad_norm"] is None  # NaN: null
    # Step 2 (skipped) saved a checkpoint, step 3 (the second in a row) did not.
    assert _steps(out) == [1, 2]


def test_disk_full_during_save_keeps_the_previous_checkpoint(tiny, tmp_path):
    trigger = tmp_path / "full"
    trigger.touch()
    out = tmp_path / "run"
    trainer = dict(fault="enospc", rank=0, at=2, trigger=str(trigger))
    with pytest.raises(CheckpointFailed) as err:
        run(tiny, out, trainer=trainer)
    message = str(err.value)
    assert "checkpoint of step 2 not saved (OSError: [Errno 28] No space left" in message
    assert "step_000001 is intact" in message and "\n" not in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]

    # A save cut short by a kill leaves its folder behind: the next start removes it and
    # resumes from the previous checkpoint.
    partial = out / "checkpoints" / "step_000002.tmp"
    shutil.copytree(out / "checkpoints" / "step_000001", partial)
    (partial / "loop_state.json").unlink()
    resumed = run(tiny, out, resume=True)
    assert not partial.exists()
    assert [r["step"] for r in resumed] == [1, 2, 3] and _steps(out) == [1, 2, 3]


def _alternating_reward(texts, answers):
    """1, 0, 1, ... within each group: every group has a learning signal, so the trainer moves
    (the tiny model's first samples rarely name the colour)."""
    return [float(i % 2 == 0) for i in range(len(texts))]


def test_stale_engine_weights_stop_the_run_and_are_judged_after_resume(tiny, tmp_path):
    """Engine and trainer in float32, the weights pushed in float32: the engine takes the
    first push (step 0's weights) and silently drops every later one. Step 1 samples from the
    trainer's own weights and stays inside the float32 band; at step 2 the trainer has moved
    (lr 1e-3) and the engine has not, and the run stops with one line naming the gap, the
    likely causes and step 1's checkpoint. Resumed with an engine that takes no push at all
    (its own initial weights, as a wrongly loaded checkpoint would leave it), the first step
    after the resume is judged and stops the run the same way."""
    band = band_of("float32")
    out = tmp_path / "run"
    float32 = dict(trainer=dict(export_dtype="float32"), compute_dtype="float32")
    with pytest.raises(LogprobMismatch) as err:
        run(tiny, out, engine=dict(pushes=1), score=_alternating_reward, **float32)
    message = str(err.value)
    assert message.startswith("step 2: the trainer's log-probs differ from the engine's")
    assert "far outside the float32 band" in message and "stale or unpushed weights" in message
    assert "step_000001 is intact" in message and "\n" not in message
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # step 2's row is logged, not saved
    assert rows[0][GAP_METRIC] < band.warn < band.stop < rows[1][GAP_METRIC]
    assert _steps(out) == [1]

    with pytest.raises(LogprobMismatch) as err:
        run(tiny, out, engine=dict(pushes=0), score=_alternating_reward, resume=True, **float32)
    assert str(err.value).startswith("step 2: ") and "step_000001 is intact" in str(err.value)


def test_a_cache_too_small_for_the_prompts_stops_before_the_update(tiny, tmp_path, caplog):
    """Step 1 rolls out, trains and saves; at step 2 the engine's KV cache is taken again with
    8 tokens, fewer than any request needs (prompt + 4 response tokens), though each fits the
    model. The run stops before step 2's update with one line: the tokens needed and held, how
    the cache was sized, the settings to change and step 1's checkpoint. Before, every request
    was skipped, the step logged "no group with a learning signal; update skipped", and the
    run went on to exit 0."""
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO), pytest.raises(RolloutFailed) as err:
        run(tiny, out, engine=dict(shrink=(_step_seed(2), 8)))
    message = str(err.value)
    assert "\n" not in message
    assert re.match(
        r"step 2: rollout: the rollout engine's KV cache cannot hold 8 of 8 requests that fit "
        r"the model; the largest: request \d+ \(\d+\): needs (\d+) KV-cache tokens, the cache "
        r"holds 8 \(cache_tokens=8, \d+ bytes a token\): give the KV cache more memory "
        r"\(--kv-cache-fraction or --rollout-cache-tokens",
        message,
    ), message
    assert "--rollout-max-response-len 4" in message and "--offload-train" in message
    checkpoint = out / "checkpoints" / "step_000001"
    assert message.endswith(
        f"; stopping before its update; the last checkpoint {checkpoint} is intact (--resume "
        "continues from it)"
    )
    # no update at step 2: no log-probs, no train step, no row, no checkpoint
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("step 1: train done") for m in said), said
    assert not any(m.startswith(("step 2: old log-probs", "step 2: train")) for m in said)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert _steps(out) == [1]
