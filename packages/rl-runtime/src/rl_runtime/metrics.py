"""Run logging: one JSON object per step in `metrics.jsonl`, a console line, W&B, a PNG plot."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward.png"
_CONSOLE_KEYS = (
    "reward_mean",
    "accuracy",
    "response_length_mean",
    "loss",
    "grad_norm",
    "clip_frac",
    "eval_accuracy",
    "perf/grpo_step_s",
    "perf/sft_step_s",
)


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `metrics.jsonl` (a torn last line from a crash is ignored)."""
    rows = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("ignoring unreadable line in %s", path)
    return rows


class RunLogger:
    """Writes step metrics to the run folder, the console and (optionally) W&B.

    `resume_step`: rows after this step (written after the checkpoint a run resumes from) are
    dropped, so the file reads as if the run had never stopped.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb: bool = False,
        wandb_project: str = "glimpse",
        run_name: str | None = None,
        group: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self._rewrite(kept)
        self._wandb = self._init_wandb(wandb_project, run_name, group, config) if wandb else None

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def _init_wandb(
        self, project: str, name: str | None, group: str | None, config: Mapping[str, Any] | None
    ):
        try:
            import wandb
        except ImportError:
            log.warning("wandb is not installed (pip install wandb); W&B logging is off")
            return None
        mode = os.environ.get("WANDB_MODE") or ("online" if _has_network() else "offline")
        if mode == "offline":
            log.info("W&B: no network, logging offline to %s/wandb", self.run_dir)
        return wandb.init(
            project=project,
            name=name,
            group=group,
            config=dict(config or {}),
            dir=str(self.run_dir),
            mode=mode,
            resume="allow",
            id=_wandb_id(self.run_dir),
        )

    def log(self, row: Mapping[str, Any]) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        shown = "  ".join(
            f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
            for k in _CONSOLE_KEYS
            if row.get(k) is not None
        )
        log.info("step %s  %s", row.get("step"), shown)
        if self._wandb is not None:
            self._wandb.log(dict(row), step=int(row.get("step", 0)))

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def plot(self) -> Path | None:
        """Reward (per step) and eval accuracy (per evaluation) as `reward.png`."""
        return plot_metrics(self.rows(), self.run_dir / PLOT_FILE)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """A stable W&B run id per run folder, so a resumed run continues the same W&B run."""
    id_file = run_dir / "wandb_id.txt"
    if id_file.is_file():
        return id_file.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return run_id


def _has_network(host: str = "api.wandb.ai", port: int = 443, timeout: float = 2.0) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def plot_metrics(rows: list[dict[str, Any]], out: str | Path) -> Path | None:
    """Draw reward_mean and eval_accuracy against step into a PNG (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    ev = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    if not steps and not ev:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if steps:
        ax.plot(steps, rewards, label="train reward (mean)", color="tab:blue", alpha=0.8)
    if ev:
        ax.plot(
            [s for s, _ in ev],
            [a for _, a in ev],
            "o-",
            label="eval accuracy (pass@1)",
            color="tab:orange",
        )
    ax.set_title("GRPO: train reward and eval accuracy per step")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy (0 to 1)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out
