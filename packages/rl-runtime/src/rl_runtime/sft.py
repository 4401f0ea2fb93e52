"""The SFT loop: batches of formatted conversations, loss on assistant tokens, checkpoints that
resume exactly, and a Hugging Face export the GRPO app can start from (`--load`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_algos import TrainBatch
from rl_runtime.checkpoint import CheckpointManager
from rl_runtime.config import option
from rl_runtime.data import PromptSampler
from rl_runtime.metrics import RunLogger
from rl_runtime.progress import step_progress
from rl_runtime.protocols import PromptSource

log = logging.getLogger(__name__)


@dataclass
class SftLoopConfig:
    sft_num_steps: int = option(500, "SFT optimizer steps", ge=1)
    sft_batch_size: int = option(64, "conversations per SFT step", ge=1)
    sft_save_interval: int = option(100, "checkpoint every N SFT steps (0: only at the end)", ge=0)
    sft_keep_checkpoints: int = option(2, "how many SFT checkpoints to keep (0: all)", ge=0)
    sft_seed: int = option(1234, "seed of the SFT data order", ge=0)


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
    """Train `cfg.sft_num_steps` steps; export the final weights to `export_dir` (HF layout)."""
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
            row |= {"num_tokens": batch.num_tokens, "skipped_rows": sampler.state.skipped}
            row |= {"time_step_s": dt, "train_tokens_per_s": batch.num_tokens / max(dt, 1e-9)}
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
