"""geo3k_sft's configuration: the packages' own configs as one tree, the recipe's values and
the presets. Nothing is declared here a second time: each setting is its package's field.

Every setting has a dotted flag (`--trainer.optim.lr`, `--sft.sft-num-steps`) and a short one
(`--lr`, `--sft-num-steps`); `--backend` picks the trainer section. The environment names
(`GEO3K_*`, then the recipes' `MILES_SCRIPT_*` and `SLIME_SCRIPT_*`) are
`rl_runtime.recipe_env_aliases`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trainers_fsdp.build
import trainers_megatron.build
from rl_runtime import (
    ActorClass,
    ClusterConfig,
    ParallelConfig,
    RunConfig,
    SftLoopConfig,
    TrainerConfig,
    check_parallel,
    choice,
    layout,
    layout_report,
    parse_config,
    recipe_env_aliases,
    section,
)
from trainers_fsdp import FsdpConfig
from trainers_megatron import MegatronConfig
from vlm_data import DataConfig
from vlm_models import ModelConfig

DESCRIPTION = """Supervised fine-tuning on Geometry3K-style rows, `uv run apps/geo3k_sft`.
The assistant reply is the recipe's `Answer: \\boxed{<answer>}` (or the row's own `messages`);
the loss covers assistant tokens only. The run folder ends with `hf/`, an HF model folder with
the processor beside it, which `uv run apps/geo3k_grpo --load <run folder>` starts from."""

TRAINERS = {"megatron": MegatronConfig, "fsdp": FsdpConfig}
#: each backend's actor class, imported on call (in a trainer rank; its settings above name
#: nothing they build)
ACTORS: dict[str, ActorClass] = {
    "megatron": trainers_megatron.build.actor_class,
    "fsdp": trainers_fsdp.build.actor_class,
}
ENV_ALIASES = recipe_env_aliases("GEO3K")


def other_trainers(backend: str) -> list[TrainerConfig]:
    """The backends not picked, in their defaults: where a layout refusal looks for a layout
    that fits."""
    return [config() for name, config in TRAINERS.items() if name != backend]


@dataclass
class Geo3kSftConfig:
    run: RunConfig = section(RunConfig)
    cluster: ClusterConfig = section(ClusterConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    trainer: MegatronConfig | FsdpConfig = choice(TRAINERS, by="backend")
    sft: SftLoopConfig = section(SftLoopConfig)

    def check(self) -> None:
        self.run = self.run.with_wandb_names(self.model.model_name)  # shown by --print-config
        check_parallel(self.trainer, self.parallel, self.cluster, with_engines=False)


#: The recipe's values where a package's default is not the recipe's (the rest are).
RECIPE: dict[str, Any] = {
    "backend": "megatron",
    "output_dir": "runs/geo3k_sft",
    "wandb_project": "glimpse-geo3k-sft",
    "template": "none",
    # miles' run_geo3k_vlm_sft.sh: adam 1e-5, cosine to 1e-6 after a 10 % warm-up, betas
    # 0.9 / 0.95, 128 conversations a step
    "lr": 1e-5,
    "lr_schedule": "cosine",
    "min_lr": 1e-6,
    "lr_warmup_fraction": 0.1,
    "adam_beta2": 0.95,
    "sft_batch_size": 128,
}

PRESETS: dict[str, dict[str, Any]] = {
    # A CPU run in minutes: a random-init tiny Qwen3-VL, the offline tiny processor and the
    # synthetic "what colour is the square" task, until the answer format is learned.
    "tiny": {
        "backend": "fsdp",
        "num_gpus": 0,
        "model_name": "qwen3-vl-tiny",
        "tokenizer": "tiny",
        "dataset": "synthetic:color",
        "attn_implementation": "sdpa",
        "output_dir": "runs/geo3k_sft_tiny",
        "lr": 3e-3,
        "lr_schedule": "constant",  # 36 steps learn the format at a constant rate
        "lr_warmup_fraction": 0.0,
        "weight_decay": 0.0,
        "sft_num_steps": 36,
        "sft_batch_size": 32,
        "sft_save_interval": 12,
    },
}


def print_layout(cfg: Geo3kSftConfig) -> dict[str, Any]:
    """`--print-config`'s training layout and its memory estimate (no engines)."""
    from vlm_models.sources import shape_of  # transformers: only when asked

    report = layout_report(
        cfg.parallel,
        cfg.cluster,
        backend=cfg.run.backend,
        trainer=cfg.trainer,
        others=other_trainers(cfg.run.backend),
        shape=shape_of(cfg.model, load=cfg.run.load) if cfg.cluster.use_gpu else None,
        model_name=cfg.model.model_name,
        with_engines=False,
    )
    if cfg.cluster.ray_to_join is None:  # where each actor goes: only on a cluster
        return {"layout": report}
    from rl_runtime import placement_preview  # Ray

    lay = layout(cfg.cluster, with_engines=False)
    return {"layout": report, "placement": placement_preview(cfg.cluster, lay)}


def parse(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> Geo3kSftConfig:
    return parse_config(
        Geo3kSftConfig,
        argv,
        env=os.environ if env is None else env,
        env_aliases=ENV_ALIASES,
        presets=PRESETS,
        defaults=RECIPE,
        description=DESCRIPTION,
        prog="geo3k_sft",
        print_extra=print_layout,
    )
