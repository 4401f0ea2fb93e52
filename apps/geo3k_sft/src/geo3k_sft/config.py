"""geo3k_sft's configuration: the packages' own configs as one tree (`SftConfig`'s sections
with this app's trainers), the recipe's values and the presets. Nothing is declared here a
second time: each setting is its package's field.

Every setting has a dotted flag (`--trainer.optim.lr`, `--sft.sft-num-steps`) and a short one
(`--lr`, `--sft-num-steps`); `--backend` picks the trainer section. The environment names
(`GEO3K_*`, then the recipes' `MILES_SCRIPT_*` and `SLIME_SCRIPT_*`) are
`rl_runtime.recipe_env_aliases`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trainers_fsdp.build
import trainers_megatron.build
from rl_runtime import ActorClass, choice, recipe_env_aliases
from rl_runtime.sft_app import SftConfig
from trainers_fsdp import FsdpConfig
from trainers_megatron import MegatronConfig

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


@dataclass
class Geo3kSftConfig(SftConfig):
    """`SftConfig`'s sections, with this app's trainers."""

    trainer: MegatronConfig | FsdpConfig = choice(TRAINERS, by="backend")


#: The recipe's values where a package's default is not the recipe's (the rest are).
DEFAULTS: dict[str, Any] = {
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
