"""The SFT loop: batches of formatted conversations, loss on assistant tokens, checkpoints that
resume exactly, and a Hugging Face export the GRPO app can start from (`--load`). `train_sft`
runs it on Ray (an SFT launcher's run); `sft_warmup` is a GRPO launcher's short format warm-up
through the same code, so that no launcher runs another."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_algos import TrainBatch
from rl_runtime.checkpoint import CheckpointManager, resume_step
from rl_runtime.cluster import Cluster
from rl_runtime.cluster_config import ClusterConfig, layout
from rl_runtime.config import to_dict
from rl_runtime.data import PromptSampler
from rl_runtime.faults import stop_with_checkpoint_note
from rl_runtime.metrics import RunLogger
from rl_runtime.progress import step_progress
from rl_runtime.protocols import ActorClass, PromptSource, TrainerConfig
from rl_runtime.run import RunConfig
from rl_runtime.sft_config import SftLoopConfig, WarmupConfig

log = logging.getLogger(__name__)


def sft_batch(samples: Sequence[Any]) -> TrainBatch:
    """A TrainBatch from SFT samples (`input_ids`, `loss_mask`, optional images)."""
    has_mm = all(getattr(s, "mm_token_type_ids", None) is not None for s in samples)
    return TrainBatch(
        input_ids=[torch.as_tensor(s.input_ids).reshape(-1).long() for s in samples],
        loss_mask=[torch.as_tensor(s.loss_mask).reshape(-1).float() for s in samples],
        pixel_values=[getattr(s, "pixel_values", None) for s in samples],
        image_grid_thw=[getattr(s, "image_grid_thw", None) for s in samples],
        mm_token_type_ids=(
            [torch.as_tensor(s.mm_token_type_ids).reshape(-1).long() for s in samples]
            if has_mm
            else None
        ),
    )


def run_sft(
    cfg: SftLoopConfig,
    *,
    train: Any,
    samples: PromptSource,
    logger: RunLogger,
    checkpoints: CheckpointManager,
    export_dir: str | Path | None = None,
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Train `cfg.sft_num_steps` steps; export the final weights to `export_dir` (HF layout).
    Ctrl-C ends in a `RunStopped` (`Interrupted`) naming the checkpoint kept."""
    with stop_with_checkpoint_note(checkpoints):
        return _run_sft(
            cfg,
            train=train,
            samples=samples,
            logger=logger,
            checkpoints=checkpoints,
            export_dir=export_dir,
            resume=resume,
        )


def _run_sft(
    cfg: SftLoopConfig,
    *,
    train: Any,
    samples: PromptSource,
    logger: RunLogger,
    checkpoints: CheckpointManager,
    export_dir: str | Path | None,
    resume: bool,
) -> list[dict[str, Any]]:
    sampler = PromptSampler(samples, seed=cfg.sft_seed)
    start = 0
    if resume and (latest := checkpoints.latest()):
        start, path = latest
        train.load_checkpoint(path / "trainer")
        sampler.load_state_dict(checkpoints.load_state(path)["sampler"])
        log.info("resumed SFT from %s (step %d)", path, start)
    with step_progress(cfg.sft_num_steps, start, "SFT") as advance:
        for step in range(start + 1, cfg.sft_num_steps + 1):
            t0 = time.perf_counter()
            batch = sft_batch(sampler.next_batch(cfg.sft_batch_size))
            metrics = train.train_step(batch, loss="sft")
            dt = time.perf_counter() - t0
            row = {f"trainer_{k}" if k == "step" else k: float(v) for k, v in metrics.items()}
            row = {"step": step, **row}
            row |= {"num_tokens": batch.num_tokens, "skipped_rows": sampler.skipped_rows}
            row |= {"perf/sft_step_s": dt, "train_tokens_per_s": batch.num_tokens / max(dt, 1e-9)}
            logger.log(row)
            if step == cfg.sft_num_steps or (
                cfg.sft_save_interval and step % cfg.sft_save_interval == 0
            ):
                state = {"sampler": sampler.state_dict()}
                checkpoints.save(step, state, train.save_checkpoint)
            advance(row)
    if export_dir is not None:
        train.export_hf(export_dir)
        log.info("SFT weights exported to %s", export_dir)
    return logger.rows()


def train_sft(
    cfg: SftLoopConfig,
    *,
    run: RunConfig,
    cluster: ClusterConfig,
    trainer: TrainerConfig,
    actor_class: ActorClass,
    samples: PromptSource,
    tp_size: int = 1,
    config: Mapping[str, Any] | None = None,
    start_step: int | None = None,
    on_export: Callable[[Path], None] | None = None,
) -> Path:
    """An SFT run on Ray into `run.output_dir`: the trainer ranks (`trainer`, completed for the
    run, built by its package's `actor_class`), the loop, checkpoints (resumed with `run.resume`) and the final weights in `hf/`,
    where `on_export(folder)` adds what loads with them (the processor). `config` is logged."""
    run_dir = Path(run.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.sft_keep_checkpoints)
    with Cluster(cluster, layout(cluster, with_engines=False)) as ray_cluster:
        train = ray_cluster.train_group(trainer, actor_class, tp_size=tp_size)
        ray_cluster.record(run_dir)
        logger = RunLogger(
            run_dir,
            wandb=run.use_wandb(os.environ),
            wandb_project=run.wandb_project,
            run_name=run.wandb_run_name,
            group=run.wandb_group,
            config=dict(config or {}),
            resume_step=start_step,
        )
        checkpoints.clean_partial()
        export = run_dir / "hf"
        run_sft(
            cfg,
            train=train,
            samples=samples,
            logger=logger,
            checkpoints=checkpoints,
            export_dir=export,
            resume=run.resume,
        )
        if on_export is not None:
            on_export(export)
        logger.close()
    log.info("SFT done: %d rows skipped; weights in %s", samples.skipped, export)
    return export


def sft_warmup(
    w: WarmupConfig,
    *,
    run: RunConfig,
    cluster: ClusterConfig,
    trainer: TrainerConfig,
    actor_class: ActorClass,
    samples: Callable[[], PromptSource],
    tp_size: int = 1,
    config: Mapping[str, Any] | None = None,
    on_export: Callable[[Path], None] | None = None,
) -> Path:
    """A GRPO run's warm-up into `<output_dir>/sft_warmup` (`trainer` already has the warm-up's
    learning rate and length); returns that folder, which GRPO then loads. A finished warm-up
    there is reused; one that left a checkpoint resumes, one killed before starts over."""
    sft_dir = Path(run.output_dir) / "sft_warmup"
    if (sft_dir / "hf" / "config.json").is_file():
        log.info("reusing the SFT warm-up in %s", sft_dir)
        return sft_dir
    log.info(
        "no --load given: running a short SFT warm-up first (%d steps, rl_runtime.train_sft) so "
        "that the random model learns the answer format; then GRPO starts from it",
        w.warmup_sft_steps,
    )
    checkpoints = CheckpointManager(sft_dir / "checkpoints")
    resume = checkpoints.latest() is not None
    warm_run = dataclasses.replace(run, output_dir=str(sft_dir), resume=resume, load=None)
    loop = w.loop(run.seed)
    settings = {**(config or {}), "sft": to_dict(loop)}
    sft_dir.mkdir(parents=True, exist_ok=True)
    (sft_dir / "config.json").write_text(json.dumps(settings, indent=2, default=str))
    train_sft(
        loop,
        run=warm_run,
        cluster=cluster,
        trainer=trainer,
        actor_class=actor_class,
        samples=samples(),
        tp_size=tp_size,
        config=settings,
        start_step=resume_step(checkpoints, sft_dir) if resume else None,
        on_export=on_export,
    )
    return sft_dir
