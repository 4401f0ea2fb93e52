"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint folder:

- DCP files: the sharded model and optimizer state (``get_state_dict``, so they reload on any
  world size);
- ``trainer_state_rank{r}.pt``: this rank's step, LR scheduler and RNG states (CPU, CUDA), so
  the next step after a resume draws the same random numbers.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

logger = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
) -> None:
    """Save model, optimizer, scheduler, RNG and step to ``path`` (collective)."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = {"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(extra, path / f"trainer_state_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    logger.info("saved checkpoint at step %d to %s", step, path)


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> int:
    """Restore what :func:`save_checkpoint` wrote; returns the step (collective)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra_file = path / f"trainer_state_rank{rank}.pt"
    if not extra_file.exists():  # resumed on more ranks than saved: take rank 0's schedule
        extra_file = path / "trainer_state_rank0.pt"
    extra = torch.load(extra_file, weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    logger.info("loaded checkpoint of step %d from %s", extra["step"], path)
    return int(extra["step"])
