"""`RunConfig`: the run folder, where its weights start, the seed and where it logs; and the
environment names the reference recipes' launchers read, which a launcher keeps honouring."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rl_runtime.config import to_dict
from rl_runtime.config_fields import option

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass
class RunConfig:
    """What a run is: its folder, its start, its seed, its logs (`backend` picks the trainer
    section of the app's config, among the trainer packages the app offers)."""

    preset: str | None = option(None, "named preset; 'tiny' runs on any CPU in minutes")
    output_dir: str = option(
        "runs/run", "the run folder (metrics, checkpoints, final weights; GRPO: reward.png)"
    )
    resume: bool = option(False, "continue from the last complete checkpoint in --output-dir")
    load: str | None = option(None, "start from these weights (an HF folder or an SFT run folder)")
    backend: str | None = option(None, "training backend")
    seed: int = option(1234, "global seed (model init, data order, sampling)", ge=0)
    wandb: bool = option(False, "log to W&B (also on when WANDB_API_KEY is set)")
    wandb_project: str = option("glimpse", "W&B project")
    wandb_group: str | None = option(
        None, "W&B group (default: <model>-<backend>, lower case, as the recipes group runs)"
    )
    wandb_run_name: str | None = option(
        None, "W&B run name (default: the group, as the recipes' --disable-wandb-random-suffix)"
    )
    log_level: str = option(
        "INFO", "logging level (DEBUG: tracebacks for errors)", choices=LOG_LEVELS
    )

    def use_wandb(self, env: Mapping[str, str]) -> bool:
        return bool(self.wandb or env.get("WANDB_API_KEY"))

    def with_wandb_names(self, model_name: str) -> RunConfig:
        """The W&B group and run name settled as the recipes set them: group
        ``<model>-<backend>`` (``qwen3-vl-8b-instruct-megatron``), the run named as its group."""
        group = self.wandb_group or f"{Path(model_name).name.lower()}-{self.backend}"
        return replace(self, wandb_group=group, wandb_run_name=self.wandb_run_name or group)


def recipe_env_aliases(prefix: str) -> dict[str, list[str]]:
    """Setting -> environment variables (first set wins): `<prefix>_*`, then the names of the
    miles and slime recipe scripts (`MILES_SCRIPT_*`, `SLIME_SCRIPT_*`)."""

    def names(suffix: str) -> list[str]:
        return [f"{prefix}_{suffix}", f"MILES_SCRIPT_{suffix}", f"SLIME_SCRIPT_{suffix}"]

    return {
        "backend": names("TRAIN_BACKEND"),
        "model_name": names("MODEL_NAME"),
        "dataset": names("DATASET_NAME"),
        "num_gpus": names("NUM_GPUS"),
        "external_ray": names("EXTERNAL_RAY"),
        "preset": [f"{prefix}_PRESET"],
        "output_dir": [f"{prefix}_OUTPUT_DIR"],
        "wandb": [f"{prefix}_WANDB"],
    }


def write_config(cfg: Any, run_dir: str | Path) -> None:
    """`config.json` in the run folder: the settings the run resolved."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
