"""Preflight: stop at once, with a useful message, when the machine cannot run the config."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class PreflightError(SystemExit):
    """Raised with the message to show; exits with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install counts as no GPU
        return 0


def check_gpus(needed: int, *, preset: str | None = None, available: int | None = None) -> None:
    """`needed` GPUs must be visible (0: CPU run, always fine)."""
    if needed <= 0:
        return
    have = count_gpus() if available is None else available
    if have >= needed:
        return
    what = "no GPU is visible" if have == 0 else f"only {have} GPU(s) are visible"
    raise PreflightError(
        f"this configuration{f' (preset {preset!r})' if preset else ''} needs {needed} GPU(s), "
        f"but {what} (torch.cuda.device_count() = {have}). Set GEO3K_NUM_GPUS / --num-gpus to "
        f"what you have, or try the CPU run: --preset tiny"
    )


def check_backend(backend: str, trainer: Any, *, use_gpu: bool) -> None:
    """The trainer package `backend` picked must import and provide its actor
    (`TrainerConfig.actor_class`), and its settings must suit the machine
    (`TrainerConfig.machine_refusal`): either stops the run before any work starts."""
    try:
        trainer.actor_class()
    except (ImportError, AttributeError) as e:
        raise PreflightError(
            f"backend {backend!r} is not available here ({type(e).__name__}: {e}); install the "
            "GPU extra (uv sync --extra gpu) or use the FSDP backend: --backend fsdp"
        ) from None
    why = trainer.machine_refusal(use_gpu=use_gpu)
    if why:
        raise PreflightError(why)
