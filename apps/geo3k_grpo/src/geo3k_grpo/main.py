"""`uv run apps/geo3k_grpo`: GRPO on Geometry3K (the miles / slime geo3k VLM recipe).

The app is its recipe, `RECIPE`: its settings (`config.py`: the packages' sections, the
recipe's values, the presets), its data (the rows `--dataset` names, prompts as the data
flags say: rl_runtime's vlm-data defaults), its reward (`--reward-type`, rewards-math), its
trainers (`--backend`: Megatron or FSDP) and its engines (SGLang, or the transformers engine).
`rl_runtime.grpo_app` does the rest: `main` parses and checks the flags, `run` settles the
model and layout, builds the parts and trains. `--preset tiny` runs the whole thing on a CPU
in minutes, after a short SFT warm-up (`rl_runtime.grpo_app.warm_up`).
"""

from __future__ import annotations

from geo3k_grpo.config import (
    ACTORS,
    DEFAULTS,
    DESCRIPTION,
    ENV_ALIASES,
    PRESETS,
    TRAINERS,
    Geo3kGrpoConfig,
)
from rl_runtime.grpo_app import Engines, GrpoRecipe

__all__ = ["PRESETS", "RECIPE", "Geo3kGrpoConfig", "check", "main", "parse", "run"]


def engines() -> Engines:
    """The rollout engines: SGLang on GPUs where it is installed, else transformers'."""
    import rollout_sglang.launch  # torch and transformers: once the flags are checked
    from rollout_sglang.types import GenerateRequest, SamplingParams

    return Engines(rollout_sglang.launch, GenerateRequest.from_prompt, SamplingParams)


RECIPE = GrpoRecipe(
    name="geo3k_grpo",
    config=Geo3kGrpoConfig,
    trainers=TRAINERS,
    actors=ACTORS,
    engines=engines,
    description=DESCRIPTION,
    defaults=DEFAULTS,
    presets=PRESETS,
    env_aliases=ENV_ALIASES,
)

parse, check, run, main = RECIPE.parse, RECIPE.check, RECIPE.run, RECIPE.main

if __name__ == "__main__":
    main()
