"""Preflight: stop at once, with a useful message, when the machine cannot run the config."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

from rl_runtime.protocols import ActorClass

log = logging.getLogger(__name__)


class PreflightError(SystemExit):
    """Raised with the message to show; exits with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def count_gpus() -> int:
    """The CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` applied), asked of the
    CUDA driver itself (``cuInit``, ``cuDeviceGetCount``), as ``torch.cuda.is_available()``
    does but without importing torch (seconds): a launcher refuses a layout for GPUs it does
    not have before it loads torch. No driver, or one that fails, counts as no GPU."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


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
        f"but {what}. Set GEO3K_NUM_GPUS / --num-gpus to what you have, or try the CPU run: "
        "--preset tiny --num-gpus 0"
    )


def check_output_dir(path: str | Path, setting: str = "--output-dir") -> None:
    """The run folder must be a folder, or one this process can create: a file there (or where
    one of its parents should be) or a folder it cannot write stops the run before anything is
    printed or written (`setting` names the flag in the message)."""
    folder = Path(path).expanduser()
    for here in (folder, *folder.parents):
        if not here.exists():
            continue
        if not here.is_dir():
            what = "a file" if here == folder else f"{here} is a file"
            raise PreflightError(f"{setting}: {path}: {what}, not a folder")
        if not os.access(here, os.W_OK | os.X_OK):
            raise PreflightError(f"{setting}: {path}: {here} is not writable")
        return


def check_backend(backend: str, trainer: Any, actor_class: ActorClass, *, use_gpu: bool) -> None:
    """The trainer package `backend` picked must import and provide its actor
    (`actor_class`, the package's `ActorClass`), and its settings must
    suit the machine (`TrainerConfig.machine_refusal`): either stops the run before any work
    starts."""
    try:
        actor_class()
    except (ImportError, AttributeError) as e:
        raise PreflightError(
            f"backend {backend!r} is not available here ({type(e).__name__}: {e}); install the "
            "GPU extra (uv sync --extra gpu) or use the FSDP backend: --backend fsdp"
        ) from None
    why = trainer.machine_refusal(use_gpu=use_gpu)
    if why:
        raise PreflightError(why)
