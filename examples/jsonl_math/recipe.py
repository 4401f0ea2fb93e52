"""GRPO on your own data with your own reward, in one file: a JSONL of text-only math
problems, scored by a `(response, answer) -> float` function. From the repository root:

    uv run python examples/jsonl_math/recipe.py --preset tiny    # --dataset my.jsonl: yours

A recipe names what this run chooses and hands it to rl-runtime's GRPO entry point
(`GrpoRecipe`): where the rows come from (`problems`), how they are scored (`reward`), the
presets and the backends (FSDP or Megatron; SGLang or the transformers engine). The entry point
does the rest, as for `apps/geo3k_grpo`: flags and their checks, the layout, Ray, the SFT
warm-up, the loop, evaluation, checkpoints and `--resume`, the weights in `hf/`. vlm-data
builds the prompts as the data flags say (rows without images give text-only prompts).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trainers_fsdp.build
import trainers_megatron.build
from rewards_math import BatchScorer, math_reward
from rl_runtime import choice, section
from rl_runtime.grpo_app import Engines, GrpoConfig, GrpoRecipe
from rollout_sglang import RolloutConfig
from trainers_fsdp import FsdpConfig
from trainers_megatron import MegatronConfig

TRAINERS = {"fsdp": FsdpConfig, "megatron": MegatronConfig}
ACTORS = {"fsdp": trainers_fsdp.build.actor_class, "megatron": trainers_megatron.build.actor_class}
SAMPLE = Path(__file__).resolve().parent / "problems.jsonl"  # 24 sums, the default --dataset


@dataclass
class JsonlMathConfig(GrpoConfig):
    """Every GRPO section, with this recipe's engines and trainers."""

    rollout: RolloutConfig = section(RolloutConfig)
    trainer: FsdpConfig | MegatronConfig = choice(TRAINERS, by="backend")


def engines() -> Engines:
    """The rollout engines, imported once the flags are checked."""
    import rollout_sglang.launch
    from rollout_sglang.types import GenerateRequest, SamplingParams

    return Engines(rollout_sglang.launch, GenerateRequest.from_prompt, SamplingParams)


def problems(cfg: JsonlMathConfig, split: str, *, eval_split: bool, stats: Counter) -> list:
    """The dataset source: `--dataset`'s lines as rows under vlm-data's column names
    (`problem`, `answer`). Every split gets the same problems: a file this small has none to
    hold out. A line that is not a problem is counted in `stats` instead of stopping the run."""
    rows: list[dict[str, str]] = []
    for line in filter(str.strip, Path(cfg.data.dataset).read_text().splitlines()):
        try:
            problem = json.loads(line)
            rows.append({"problem": problem["question"], "answer": str(problem["answer"])})
        except (ValueError, KeyError, TypeError):
            stats["malformed_line"] += 1
    return rows


def reward(cfg: JsonlMathConfig) -> BatchScorer:
    """Any picklable `(response, answer) -> float` in a `BatchScorer` (a rollout's responses
    scored as a batch, in `--reward-workers` processes, each under a timeout). Here
    rewards-math's: 1 when the last \\boxed{} of the response equals the answer, else 0."""
    return BatchScorer(math_reward, num_workers=cfg.reward.reward_workers)


PRESETS: dict[str, dict[str, Any]] = {
    # Any CPU in minutes: a random-init tiny Qwen3-VL. A random model never writes \boxed{}, so
    # an SFT warm-up first teaches the format (`Answer: \boxed{7}`); GRPO then raises the
    # sampled reward. The question alone (`template: none`) is learned faster than with the
    # boxed template's instruction.
    "tiny": {
        "backend": "fsdp",
        "num_gpus": 0,
        "model_name": "qwen3-vl-tiny",
        "tokenizer": "tiny",
        "attn_implementation": "sdpa",
        "rollout_engine": "hf",
        "template": "none",
        "output_dir": "runs/jsonl_math_tiny",
        "loss_agg_mode": "token-mean",
        "num_rollout": 30,
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 8,
        "global_batch_size": 64,
        "rollout_temperature": 1.0,
        "rollout_max_response_len": 16,
        "eval_interval": 10,
        "save_interval": 10,
        "lr": 5e-4,
        "weight_decay": 0.0,
        "reward_workers": 1,
        "warmup_sft_steps": 120,
        "warmup_sft_batch_size": 24,
        "warmup_sft_lr": 3e-3,
    },
}

RECIPE = GrpoRecipe(
    name="jsonl_math",
    config=JsonlMathConfig,
    trainers=TRAINERS,
    actors=ACTORS,
    engines=engines,
    rows=problems,
    reward=reward,
    presets=PRESETS,
    defaults={"backend": "fsdp", "dataset": str(SAMPLE)},
    description="GRPO on a JSONL of math problems (question, answer) with the math reward.",
)

if __name__ == "__main__":
    RECIPE.main()
