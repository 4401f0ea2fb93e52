"""`uv run apps/geo3k_sft`: supervised fine-tuning on Geometry3K-style rows.

The app is its recipe, `RECIPE`: its settings (`config.py`), its data (the rows `--dataset`
names, each an `Answer: \\boxed{<answer>}` reply or the row's own messages: rl_runtime's
vlm-data defaults) and its trainers (`--backend`). `rl_runtime.sft_app` does the rest: `main`
parses and checks the flags, `run` settles the model and layout, builds the samples and the
trainer and trains. The run folder ends with `hf/`, which
`uv run apps/geo3k_grpo --load <run folder>` starts from.
"""

from __future__ import annotations

from geo3k_sft.config import (
    ACTORS,
    DEFAULTS,
    DESCRIPTION,
    ENV_ALIASES,
    PRESETS,
    TRAINERS,
    Geo3kSftConfig,
)
from rl_runtime.sft_app import SftRecipe

__all__ = ["PRESETS", "RECIPE", "Geo3kSftConfig", "check", "main", "parse", "run"]

RECIPE = SftRecipe(
    name="geo3k_sft",
    config=Geo3kSftConfig,
    trainers=TRAINERS,
    actors=ACTORS,
    description=DESCRIPTION,
    defaults=DEFAULTS,
    presets=PRESETS,
    env_aliases=ENV_ALIASES,
)

parse, check, run, main = RECIPE.parse, RECIPE.check, RECIPE.run, RECIPE.main

if __name__ == "__main__":
    main()
