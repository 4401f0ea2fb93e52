"""The GRPO loop, in one file: sample prompts, roll out, score, advantages, log-probs, train,
sync weights, evaluate, log, checkpoint. It sees only the groups and callables in `GrpoParts`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_algos import compute_grpo_advantages, filter_zero_variance_groups
from rl_algos.batch import TrainBatch
from rl_runtime.checkpoint import CheckpointManager
from rl_runtime.data import PromptPrefetch, PromptSampler
from rl_runtime.evaluation import eval_prompts, evaluate
from rl_runtime.faults import NonFiniteStop, RestartingRollout, stop_with_checkpoint_note
from rl_runtime.logprob_guard import LogprobGapGuard
from rl_runtime.loop_config import GrpoLoopConfig
from rl_runtime.metrics import RunLogger
from rl_runtime.progress import (
    HEARTBEAT_S,
    Phase,
    eval_notes,
    phase,
    rollout_figures,
    step_progress,
    transfer_notes,
)
from rl_runtime.protocols import KV_CACHE, WEIGHTS, Decoder, PromptSource
from rl_runtime.rollout_batch import ScoredGroups, build_train_batch
from rl_runtime.rollout_guard import check_rollout

log = logging.getLogger(__name__)


@dataclass
class GrpoParts:
    """What the app assembles: the two groups, the data, the reward, the run folder."""

    train: Any  # TrainGroup
    rollout: Any  # RolloutGroup
    train_prompts: PromptSource
    decode: Decoder
    score: Callable[[Sequence[str], Sequence[str]], list[float]]
    logger: RunLogger
    checkpoints: CheckpointManager
    eval_prompts: PromptSource | None = None
    resume: bool = False
    offload_between_phases: bool = False  # colocated on GPUs
    # the engines were started before the trainers and released their memory (SGLang sizes
    # its KV pool from the memory free at its start): the first push resumes them by parts
    engines_released: bool = False
    # Ids a response must not contain (image / video placeholders): such a response cannot be
    # scored by the trainer (its image tokens would have no image), so it is dropped and counted.
    forbidden_token_ids: frozenset[int] = frozenset()
    # The coarsest of the engine's and the trainer's compute dtypes and the pushed weights'
    # (the trainers push bfloat16 by default): the band of the log-prob gap between engine and
    # trainer (rl_runtime.logprob_guard.coarsest_dtype).
    compute_dtype: str = "bfloat16"
    # the model family whose own band the gap is judged in (logprob_guard.FAMILY_BANDS)
    gap_family: str | None = None
    extra_loop_state: dict[str, Any] = field(default_factory=dict)


class Timer:
    """Times a step's phases into its row (``time_<name>_s``) and logs each one's start, its end
    with its figures (set on the yielded `Phase`) and, while it runs, a line every
    ``heartbeat_s`` (`rl_runtime.progress.phase`). ``shown=False``: a part of a phase, logged
    at DEBUG."""

    def __init__(self, step: int = 0, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.step = step
        self.heartbeat_s = heartbeat_s

    @contextmanager
    def __call__(self, name: str, *, shown: bool = True, **figures: Any) -> Iterator[Phase]:
        t = time.perf_counter()
        with self.phase(name.replace("_", " "), shown=shown, **figures) as current:
            yield current
        self.times[f"time_{name}_s"] += time.perf_counter() - t

    def phase(
        self, label: str, *, shown: bool = True, **figures: Any
    ) -> AbstractContextManager[Phase]:
        """A phase logged, not timed into the row."""
        level = logging.INFO if shown else logging.DEBUG
        name = f"step {self.step}: {label}"
        return phase(name, heartbeat_s=self.heartbeat_s, level=level, **figures)


def run_grpo(cfg: GrpoLoopConfig, p: GrpoParts) -> list[dict[str, Any]]:
    """Train for `cfg.num_rollout` steps (continuing from the last checkpoint when resuming).
    A fault that stops the run, and Ctrl-C, end in a `RunStopped` naming the checkpoint kept."""
    with stop_with_checkpoint_note(p.checkpoints):
        return _run_grpo(cfg, p)


def _run_grpo(cfg: GrpoLoopConfig, p: GrpoParts) -> list[dict[str, Any]]:
    sampler = PromptSampler(p.train_prompts, seed=cfg.rollout_seed)
    rng = np.random.default_rng(cfg.rollout_seed)
    start = 0
    p.checkpoints.clean_partial()  # a save cut short (killed, disk full) is never resumed from
    if p.resume and (latest := p.checkpoints.latest()):
        start, path = latest
        state = p.checkpoints.load_state(path)
        p.train.load_checkpoint(path / "trainer")
        sampler.load_state_dict(state["sampler"])
        rng.bit_generator.state = state["rng"]
        log.info("resumed from %s (step %d)", path, start)
    evals = eval_prompts(p.eval_prompts, cfg.eval_max_prompts) if p.eval_prompts else []
    sampling = dict(temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p)
    sampling["max_new_tokens"] = cfg.rollout_max_response_len
    if p.engines_released:  # started before the trainers and released (SGLang, colocated)
        p.rollout.resume_memory(WEIGHTS)
    with phase("initial weight push", heartbeat_s=cfg.progress_interval_s):
        p.train.push_weights(p.rollout, cfg.weight_bucket_mb << 20)  # engines start from it
    if p.offload_between_phases:  # colocated: the first rollout needs the GPU memory
        p.train.release_cache()  # what the first push cached, the state kept or not
        _offload(p, cfg)
    if p.engines_released:
        p.rollout.resume_memory(KV_CACHE)
    engines = RestartingRollout(p.rollout, lambda: _resync(p, cfg), cfg.max_rollout_retries)
    if evals and cfg.eval_interval and cfg.eval_before_train and start == 0:
        # the curve's start, as miles evaluates at step 0: a row of its own, step 0
        timer = Timer(0, cfg.progress_interval_s)
        with timer("eval") as current:
            row = {"step": 0, **_evaluate(p, engines, evals, cfg, 0)}
            current.notes += eval_notes(row)
        p.logger.log(row | timer.times)
    # the next step's prompts are built while this step computes log-probs, trains and syncs
    prompts_ahead = PromptPrefetch(sampler, cfg.rollout_batch_size)
    nonfinite_in_row = 0
    gap_guard = LogprobGapGuard(
        p.compute_dtype, cfg.logprob_gap_warn, cfg.logprob_gap_stop, family=p.gap_family
    )
    with (
        closing(prompts_ahead),
        step_progress(cfg.num_rollout, start, "GRPO") as advance,
    ):
        for step in range(start + 1, cfg.num_rollout + 1):
            timer = Timer(step, cfg.progress_interval_s)
            t_step, row = time.perf_counter(), {"step": step}
            # 1. Rollout: n responses for each prompt; an engine's groups are scored as soon
            # as they arrive while other engines still generate.
            with timer("rollout") as current:
                prompts = prompts_ahead.take()
                scored = ScoredGroups(prompts, p.decode, p.score, p.forbidden_token_ids)
                seed = cfg.rollout_seed * 1_000_003 + step
                groups = engines.generate(
                    prompts, n=cfg.n_samples_per_prompt, seed=seed, on_ready=scored, **sampling
                )
                # the engines' split of the rollout time (a group that keeps none gives nothing)
                row.update(_engine_stats(getattr(p.rollout, "engine_stats", dict)()))
                rollout_figures(current, groups, row)
            # a rollout the engine could not run stops the run here, before any update
            check_rollout(
                groups,
                where=f"step {step}: rollout",
                ending="stopping before its update",
                max_response_len=cfg.rollout_max_response_len,
            )
            # 2. Reward, over every usable completion (engine errors and completions holding
            # an image placeholder are counted and dropped): what is not scored yet.
            with timer("reward") as current:
                flat, rewards, bad, row["malformed_completions"] = scored.finish(groups)
                current.samples = len(rewards)
            if row["malformed_completions"]:
                log.warning(
                    "step %d: %d completion(s) dropped before the reward: the response holds an "
                    "image or video placeholder token, which the trainer cannot score "
                    "(malformed_completions)",
                    step,
                    row["malformed_completions"],
                )
            # 3. Advantages within each prompt's group; optional dynamic-sampling filter.
            gids = torch.tensor([g for g, _, _ in flat])
            r = torch.tensor(rewards, dtype=torch.float64)
            adv = compute_grpo_advantages(
                r,
                group_ids=gids,
                std_normalization=cfg.std_normalization,
                reward_dtype=getattr(torch, cfg.reward_dtype),
            )
            keep = list(range(len(flat)))
            if cfg.dynamic_sampling:
                kept = filter_zero_variance_groups(r, group_ids=gids)
                keep = kept.keep_indices.tolist()
                row["dynamic_sampling_kept_frac"] = len(keep) / max(1, len(flat))
            lengths = [len(c.token_ids) for _, _, c in flat]
            row.update(_rollout_stats(rewards, lengths, flat, bad, cfg))
            row["skipped_rows"] = sampler.skipped_rows
            if step < cfg.num_rollout:
                prompts_ahead.start()
            # 4. Old (and reference) log-probs, then the policy update.
            if keep:
                batch = build_train_batch(
                    [flat[i][1] for i in keep], [flat[i][2] for i in keep], adv[keep].float()
                )
                tokens = batch.num_tokens
                if p.offload_between_phases:
                    with timer("onload") as current:  # colocated: the engine gives the GPU up
                        p.rollout.release_memory()
                        row.update(moved := _onload(p, cfg))
                        current.notes += transfer_notes(moved)
                with timer("logprobs", shown=False):
                    if cfg.use_rollout_logprobs:
                        batch.old_logprobs = _engine_logprobs(batch)
                    else:
                        with timer.phase("old log-probs", tokens=tokens):
                            batch.old_logprobs = p.train.compute_logprobs(batch)
                    if cfg.use_ref_logprobs:
                        with timer.phase("reference log-probs", tokens=tokens):
                            batch.ref_logprobs = p.train.compute_logprobs(batch, reference=True)
                with timer("train", tokens=tokens) as current:
                    row.update(_train(p.train, batch, cfg.global_batch_size, rng))
                    current.notes.append(f"{row['optimizer_steps']} optimizer step(s)")
                # A non-finite loss or gradient: the trainer skipped that update; count it.
                nonfinite_in_row = nonfinite_in_row + 1 if row["nonfinite_updates"] else 0
                row["nonfinite_steps_in_row"] = nonfinite_in_row
                row["train_tokens_per_s"] = batch.num_tokens / max(
                    timer.times["time_train_s"], 1e-9
                )
                # 5. Weight sync: the engines sample from the updated policy next step.
                # (time_sync_s is the whole phase; its parts are timed too)
                with timer("sync") as current:
                    row.update(synced := _sync(p, cfg, engines, timer))
                    current.notes += transfer_notes(synced)
            else:
                log.warning("step %d: no group with a learning signal; update skipped", step)
            # 6. Evaluation every eval_interval steps and at the end.
            if (
                evals
                and cfg.eval_interval
                and (step % cfg.eval_interval == 0 or step == cfg.num_rollout)
            ):
                with timer("eval") as current:
                    row.update(_evaluate(p, engines, evals, cfg, step))
                    current.notes += eval_notes(row)
            row["engine_restarts"] = engines.restarts
            row.update(timer.times)
            row["perf/grpo_step_s"] = time.perf_counter() - t_step  # the whole GRPO step
            row["rollout_tokens_per_s"] = sum(lengths) / max(timer.times["time_rollout_s"], 1e-9)
            p.logger.log(row)
            if "eval_accuracy" in row:
                p.logger.plot()
            if cfg.max_nonfinite_steps and nonfinite_in_row >= cfg.max_nonfinite_steps:
                raise NonFiniteStop(
                    f"step {step}: {nonfinite_in_row} steps in a row had a non-finite loss or "
                    f"gradient (--max-nonfinite-steps {cfg.max_nonfinite_steps}); stopping "
                    "before saving it"
                )
            gap_guard.check(step, row)  # engine and trainer evaluate the same model
            # 7. Checkpoint (after the row is logged, so a resumed run rewrites nothing twice).
            if step == cfg.num_rollout or (cfg.save_interval and step % cfg.save_interval == 0):
                with timer.phase("save") as current:
                    current.notes.append(str(_save(p, cfg, engines, step, prompts_ahead, rng)))
            advance(row)
    p.logger.plot()
    return p.logger.rows()


def _rollout_stats(rewards, lengths, flat, bad, cfg) -> dict[str, float]:
    n = max(1, len(rewards))
    truncated = sum(c.finish_reason == "length" for _, _, c in flat)
    return {
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "reward_std": float(np.std(rewards)) if rewards else 0.0,
        "accuracy": sum(x >= 1.0 for x in rewards) / n,
        "response_length_mean": float(np.mean(lengths)) if lengths else 0.0,
        "response_length_max": max(lengths, default=0),
        "truncated_frac": truncated / n,
        "bad_completions": bad,
        "num_samples": len(rewards),
    }


def _engine_stats(stats: dict[str, float]) -> dict[str, float]:
    """The engines' account as row metrics: seconds under ``time_rollout_engine*`` (volatile,
    like the loop's timers), counts under ``rollout_*``."""
    out = {}
    for k, v in stats.items():
        if k == "seconds":
            out["time_rollout_engine_s"] = v
        elif k.endswith("_s"):
            out[f"time_rollout_engine_{k}"] = v
        else:
            out[f"rollout_{k}"] = v
    return out


def _train(train, batch, global_batch_size: int, rng: np.random.Generator) -> dict[str, float]:
    """One optimizer step per `global_batch_size` samples (shuffled); metrics averaged."""
    order = rng.permutation(len(batch)).tolist()
    chunks = [order[i : i + global_batch_size] for i in range(0, len(order), global_batch_size)]
    totals: dict[str, list[float]] = defaultdict(list)
    for chunk in chunks:
        for k, v in train.train_step(batch.select(chunk), loss="grpo").items():
            totals[_metric_name(k)].append(float(v))
    skipped = int(sum(totals.get("update_skipped", [])))
    out = {k: float(np.mean(v)) for k, v in totals.items()}
    return out | {"optimizer_steps": len(chunks), "nonfinite_updates": skipped}


def _offloads(p: GrpoParts, cfg: GrpoLoopConfig) -> bool:
    """Whether the trainer's state leaves the GPU while the engines generate."""
    return p.offload_between_phases and cfg.offload_train is not False


def _engine_logprobs(batch: TrainBatch) -> list[torch.Tensor]:
    """The engine's log-probs as the old log-probs (``--use-rollout-logprobs``)."""
    if batch.rollout_logprobs is None:
        raise RuntimeError(
            "--use-rollout-logprobs: the rollout engine returned no log-probs for this batch; "
            "run without it (the trainer then recomputes them)"
        )
    return batch.rollout_logprobs


def _onload(p: GrpoParts, cfg: GrpoLoopConfig) -> dict[str, float]:
    """The trainer's state back (colocated); the copy's metrics (``perf/onload_gbps``...)."""
    return (p.train.onload() or {}) if _offloads(p, cfg) else {}


def _offload(p: GrpoParts, cfg: GrpoLoopConfig) -> dict[str, float]:
    """The trainer's state to the host (colocated); the copy's metrics."""
    return (p.train.offload() or {}) if _offloads(p, cfg) else {}


def _resync(p: GrpoParts, cfg: GrpoLoopConfig) -> None:
    """Give restarted engines the current weights (the trainer onloaded for it if needed);
    colocated, the push's buffers are given back before the engines take their KV cache."""
    _onload(p, cfg)
    p.train.push_weights(p.rollout, cfg.weight_bucket_mb << 20)
    if p.offload_between_phases:
        p.train.release_cache()
    _offload(p, cfg)


def _metric_name(key: str) -> str:
    """Trainer metrics keep their names, except those that clash with the loop's own."""
    return f"trainer_{key}" if key == "step" else key


class _Checked:
    """The engines as an evaluation sees them: its rollouts are judged as the training ones
    (rl_runtime.rollout_guard), so a cache too small for the eval prompts stops the run rather
    than scoring every prompt 0."""

    def __init__(self, engines: RestartingRollout, step: int, max_response_len: int) -> None:
        self.engines, self.step, self.max_response_len = engines, step, max_response_len

    def generate(self, prompts: Sequence[Any], **kwargs: Any) -> list[list[Any]]:
        groups = self.engines.generate(prompts, **kwargs)
        check_rollout(
            groups,
            where=f"step {self.step}: evaluation",
            ending="stopping before the first update"
            if self.step == 0
            else "stopping before saving it",
            max_response_len=self.max_response_len,
        )
        return groups


def _evaluate(p: GrpoParts, engines, evals, cfg: GrpoLoopConfig, step: int) -> dict[str, float]:
    return evaluate(
        _Checked(engines, step, cfg.rollout_max_response_len),
        evals,
        decode=p.decode,
        score=p.score,
        n=cfg.n_samples_per_eval_prompt,
        batch_size=cfg.rollout_batch_size,
        temperature=(
            cfg.rollout_temperature if cfg.eval_temperature is None else cfg.eval_temperature
        ),
        top_p=1.0,
        max_new_tokens=cfg.rollout_max_response_len,
        seed=cfg.rollout_seed * 7_919 + step,
    )


def _sync(
    p: GrpoParts, cfg: GrpoLoopConfig, engines: RestartingRollout, timer: Timer
) -> dict[str, float]:
    """The trainer's weights into the engines (an engine that dies in the push is restarted);
    the offload's metrics. Colocated, the engines' memory comes back around the push in slime's
    order: the trainer's allocator gives back its cache (the step's activations: over 100 GiB
    for Megatron on a 2B model), the engines' weights return for the push, and their KV cache
    only once the trainer has given back the push's buffers (``release_cache`` again: its
    allocator keeps them cached, and the transformers engine's planned cache, sized beside
    what the trainer keeps, would not fit beside them) and its state has left the GPU where it
    leaves, so the state and the engines' whole memory never need to fit at once. Parts timed
    as ``sync_resume``, ``sync_push``, ``sync_offload``."""
    if p.offload_between_phases:
        with timer("sync_resume", shown=False):
            p.train.release_cache()
            p.rollout.resume_memory(WEIGHTS)
    with timer("sync_push", shown=False) as push:
        engines.sync(lambda: p.train.push_weights(p.rollout, cfg.weight_bucket_mb << 20))
    out = _push_metrics(getattr(p.train, "last_push_bytes", None), push.seconds)
    if p.offload_between_phases:
        with timer("sync_offload", shown=False):
            p.train.release_cache()  # the push's staging buffers, the state kept or not
            out |= _offload(p, cfg)
            p.rollout.resume_memory(KV_CACHE)
    return out


def _push_metrics(pushed_bytes: int | None, seconds: float) -> dict[str, float]:
    """``perf/sync_gb`` and ``perf/sync_gbps``: the bytes trainer rank 0 pushed (the trainer
    group counts them) over the push's time, engines' loading included; none where the trainer
    does not count them."""
    if pushed_bytes is None:
        return {}
    gb = pushed_bytes / 1e9
    return {"perf/sync_gb": gb, "perf/sync_gbps": gb / seconds if seconds > 0 else 0.0}


def _save(
    p: GrpoParts,
    cfg: GrpoLoopConfig,
    engines: RestartingRollout,
    step: int,
    sampler: PromptPrefetch,
    rng: np.random.Generator,
) -> Path:
    """Checkpoint ``step``; returns its folder."""
    # colocated, the trainer's state comes back for the save: the engine makes room first
    # (its KV cache and the trainer's state need not fit at once) and returns after as at a
    # sync. A release drops the engine's weights (SGLang without a CPU backup, the
    # transformers engine without --weights-cpu-backup), so they are pushed again.
    room = _offloads(p, cfg)
    if room:
        p.rollout.release_memory()
        _onload(p, cfg)
    state = {"sampler": sampler.state_dict(), "rng": rng.bit_generator.state}
    path = p.checkpoints.save(step, state | p.extra_loop_state, p.train.save_checkpoint)
    if room:
        _sync(p, cfg, engines, Timer(step, 0.0))
    return path
