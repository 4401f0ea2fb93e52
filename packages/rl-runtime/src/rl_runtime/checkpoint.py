"""Atomic checkpoints: write everything into a temporary folder, then rename it into place.

A checkpoint folder `step_000040/` holds `trainer/` (written by the trainer actors) and
`loop_state.json` (step, data sampler position, RNG state, anything the loop needs). The rename
is the commit: a crash at any moment during a save leaves at most a `*.tmp` folder, which is
ignored and cleaned up, and the previous checkpoint stays usable.

`keep_last` counts the newest checkpoints kept (0 or None: all); the one just saved is never
removed. `resume_step` refuses a `--resume` that would silently replace an earlier run's metrics.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_runtime.faults import CheckpointFailed, last_checkpoint_note, short_error
from rl_runtime.metrics import METRICS_FILE, read_metrics
from rl_runtime.preflight import PreflightError

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
LOOP_STATE = "loop_state.json"
TRAINER_DIR = "trainer"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and finds checkpoints under `root` (usually `<run dir>/checkpoints`)."""

    def __init__(self, root: str | Path, *, keep_last: int | None = 2) -> None:
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0: keep all), not {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def complete(self) -> list[tuple[int, Path]]:
        """All complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / LOOP_STATE).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        done = self.complete()
        return done[-1] if done else None

    def clean_partial(self) -> None:
        """Remove folders left by a save that never finished."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.endswith(".tmp"):
                log.warning("removing unfinished checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def save(
        self, step: int, loop_state: dict[str, Any], write_trainer: Callable[[Path], None]
    ) -> Path:
        """Write a checkpoint for `step`. `write_trainer(path)` stores the trainer state in
        `path` (a folder that exists). Returns the final folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._write(tmp, step, loop_state, write_trainer)
        except Exception as err:
            # A full disk (or any failure mid-write): free the space the partial save took now,
            # keep the previous checkpoint, and stop with one line.
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointFailed(
                f"checkpoint of step {step} not saved ({short_error(err)}); its unfinished "
                f"folder was removed; {last_checkpoint_note(self)}"
            ) from err
        if final.exists():
            # Re-saving a step (e.g. after a resume): move the old one aside first.
            old = final.with_name(final.name + ".old.tmp")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        log.info("checkpoint saved: %s", final)
        self._prune()
        return final

    @staticmethod
    def _write(
        tmp: Path, step: int, loop_state: dict[str, Any], write_trainer: Callable[[Path], None]
    ) -> None:
        tmp.mkdir()
        trainer_dir = tmp / TRAINER_DIR
        trainer_dir.mkdir()
        write_trainer(trainer_dir)
        with open(tmp / LOOP_STATE, "w") as f:
            json.dump({"step": step, **loop_state}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

    def load_state(self, path: Path) -> dict[str, Any]:
        with open(path / LOOP_STATE) as f:
            return json.load(f)

    def _prune(self) -> None:
        if not self.keep_last:
            return
        done = self.complete()
        for _, p in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(p, ignore_errors=True)


class ResumeError(PreflightError):
    """`--resume` found nothing to resume, and starting fresh would lose an earlier run's data."""


def resume_step(checkpoints: CheckpointManager, run_dir: str | Path) -> int:
    """The step a `--resume` continues from: the latest complete checkpoint, or 0 for a run
    folder with no metrics yet. A folder whose `metrics.jsonl` has rows but no checkpoint is
    refused (`ResumeError`): starting fresh would replace those rows."""
    latest = checkpoints.latest()
    if latest is not None:
        return latest[0]
    _refuse_replacing_metrics(checkpoints, run_dir)
    log.warning("--resume: no checkpoint in %s yet; starting from step 0", checkpoints.root)
    return 0


def check_resume(run_dir: str | Path) -> None:
    """`--resume` checked before anything is printed or started: the `ResumeError` of
    `resume_step`, at once (the launchers call it with their other checks)."""
    checkpoints = CheckpointManager(Path(run_dir) / "checkpoints")
    if checkpoints.latest() is None:
        _refuse_replacing_metrics(checkpoints, run_dir)


def _refuse_replacing_metrics(checkpoints: CheckpointManager, run_dir: str | Path) -> None:
    metrics = Path(run_dir) / METRICS_FILE
    rows = read_metrics(metrics)
    if rows:
        last = max((r.get("step", 0) for r in rows), default=0)
        raise ResumeError(
            f"--resume: no complete checkpoint in {checkpoints.root}, but {metrics} holds "
            f"{len(rows)} rows (up to step {last}) that a fresh start would replace; "
            "run without --resume to start over (move the file away to keep it)"
        )
