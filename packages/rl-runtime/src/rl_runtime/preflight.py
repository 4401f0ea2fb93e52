"""Preflight: stop at once, with a useful message, when the machine cannot run the config."""

from __future__ import annotations

import importlib
import logging

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


def check_backend(backend: str, *, actor_attr: str = "MegatronActor") -> None:
    """The training backend must be importable and provide its actor."""
    if backend == "fsdp":
        return
    if backend != "megatron":
        raise PreflightError(f"unknown training backend {backend!r}: choose megatron or fsdp")
    try:
        mod = importlib.import_module("trainers_megatron")
    except ImportError as e:
        raise PreflightError(
            f"backend 'megatron' needs the trainers_megatron package ({e}); install the GPU "
            "extra (uv sync --extra gpu) or use GEO3K_TRAIN_BACKEND=fsdp / --backend fsdp"
        ) from None
    if not hasattr(mod, actor_attr):
        raise PreflightError(
            f"backend 'megatron' is not available yet: trainers_megatron provides no "
            f"{actor_attr}. Use the FSDP backend: GEO3K_TRAIN_BACKEND=fsdp or --backend fsdp"
        )
