"""The GRPO launcher's configuration: sections, the recipe defaults, the presets.

Defaults are the miles / slime geo3k recipe's. Every field is a flag (`--help`); the
environment aliases (`GEO3K_*`, `MILES_SCRIPT_*`, `SLIME_SCRIPT_*`) are in
`geo3k_sft.common.ENV_ALIASES`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from geo3k_sft.common import (
    ENV_ALIASES,
    TINY_RUN,
    DataSection,
    ModelSection,
    OptimSection,
    RunSection,
    check_backend_options,
)
from geo3k_sft.preflight import layout_report
from rl_algos.losses import KlType, LossAggMode
from rl_runtime import ConfigError, GrpoLoopConfig, option, parse_config

DESCRIPTION = """GRPO on Geometry3K (the miles / slime geo3k VLM recipe), `uv run apps/geo3k_grpo`.
Defaults are the recipe's: 64 prompts x 8 samples per rollout, global batch 512, temperature
0.8, responses up to 4096 tokens, eps_clip 0.2 / 0.28, no KL, lr 1e-6 constant, Adam betas
0.9 / 0.98, weight decay 0.1, the math reward, evaluation every 20 steps on the test split.
--preset tiny runs the whole thing on a CPU in minutes (with a short SFT warm-up first)."""


def _rewards() -> list[str]:
    from rewards_math import REWARDS

    return list(REWARDS)


def reward_options(loss: LossSection) -> dict[str, float]:
    """The reward's keyword options."""
    return {"tolerance": loss.reward_tolerance} if loss.reward_tolerance else {}


@dataclass
class RolloutSection:
    rollout_engine: Literal["auto", "sglang", "hf"] = option(
        "auto", "rollout engine; auto: SGLang on GPUs when installed, else transformers"
    )
    rollout_max_batch_size: int = option(
        256, "transformers engine: sequences decoding at once (KV-cache slots)", ge=1
    )
    sglang_mem_fraction_static: float = option(
        0.6, "SGLang: GPU memory fraction for weights+KV", gt=0, lt=1
    )
    rollout_num_gpus_per_engine: int = option(
        1, "GPUs per rollout engine (SGLang tensor parallel)", ge=1
    )
    sglang_mm_attention_backend: str | None = option(
        None, "SGLang vision attention kernel ('sdpa' on B200, where fa3 is missing)"
    )
    weight_transport: Literal["auto", "object-store", "cuda-ipc", "nccl"] = option(
        "auto",
        "how weights reach the engines; auto: CUDA IPC colocated on one trainer GPU, NCCL to "
        "SGLang on GPUs of its own, else Ray's object store (which serves every layout)",
    )


@dataclass
class LossSection:
    eps_clip: float = option(0.2, "PPO clip range (lower)", gt=0, lt=1)
    eps_clip_high: float = option(0.28, "PPO clip range (upper, clip-higher)", gt=0)
    kl_coef: float = option(0.0, "KL penalty coefficient (0: no KL, no reference model)", ge=0)
    kl_type: str = option("low_var_kl", "KL estimator", choices=get_args(KlType))
    entropy_coef: float = option(0.0, "entropy bonus coefficient")
    loss_agg_mode: str = option("token-mean", "loss aggregation", choices=get_args(LossAggMode))
    use_tis: bool = option(False, "truncated importance sampling against the rollout log-probs")
    reward_type: str = option("math", "reward", choices=_rewards)
    reward_tolerance: float = option(
        0.0, "geo3k / math_format: relative numeric tolerance (the recipes tried 0.05)", ge=0
    )
    reward_workers: int | None = option(
        None, "processes that score responses (default: cores)", ge=1
    )

    def check(self) -> None:
        """The reward is built once here so that a bad option stops the run before any work."""
        from rewards_math import build

        try:
            build(self.reward_type, **reward_options(self))
        except ValueError as err:
            raise ConfigError(f"--reward-type / --reward-tolerance: {err}") from None


@dataclass
class WarmupSection:
    warmup_sft_steps: int = option(
        0, "without --load: SFT steps to run first (the tiny preset's format warm-up)", ge=0
    )
    warmup_sft_batch_size: int = option(32, "SFT warm-up batch size", ge=1)
    warmup_sft_lr: float = option(3e-3, "SFT warm-up learning rate", gt=0)


@dataclass
class Geo3kGrpoConfig:
    run: RunSection = field(default_factory=lambda: RunSection(output_dir="runs/geo3k_grpo"))
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    loop: GrpoLoopConfig = field(default_factory=GrpoLoopConfig)
    warmup: WarmupSection = field(default_factory=WarmupSection)

    def check(self) -> None:
        check_backend_options(self.run, self.model)


PRESETS: dict[str, dict[str, Any]] = {
    # A CPU run in minutes: a random-init tiny Qwen3-VL, the offline tiny processor and the
    # synthetic "what colour is the square" task. The warm-up teaches the answer format (greedy
    # answers are right, sampled ones mostly are not); GRPO then raises the sampled reward.
    "tiny": {
        **TINY_RUN,
        "template": "none",
        "output_dir": "runs/geo3k_grpo_tiny",
        "rollout_engine": "hf",
        "num_rollout": 30,
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "global_batch_size": 64,
        "rollout_temperature": 1.0,
        "rollout_max_response_len": 16,
        "eval_interval": 10,
        "eval_max_prompts": 32,
        "save_interval": 10,
        "lr": 5e-4,
        "weight_decay": 0.0,
        "reward_workers": 1,
        "warmup_sft_steps": 36,
        "warmup_sft_batch_size": 32,
        "warmup_sft_lr": 3e-3,
    },
}


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None):
    return parse_config(
        Geo3kGrpoConfig,
        argv,
        env=os.environ if env is None else env,
        env_aliases=ENV_ALIASES,
        presets=PRESETS,
        description=DESCRIPTION,
        prog="geo3k_grpo",
        print_extra=lambda cfg: {"layout": layout_report(cfg.model, cfg.run)},
    )
