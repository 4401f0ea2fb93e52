"""Checked by mypy (the root pyproject's [tool.mypy]), never run: each trainer config is
assigned to rl-runtime's `TrainerConfig` protocol, so a method whose signature drifts from the
protocol's fails the type check instead of a launcher at run time."""

from __future__ import annotations

from rl_runtime.protocols import TrainerConfig
from trainers_fsdp.config import FsdpConfig
from trainers_megatron.config import MegatronConfig

fsdp: TrainerConfig = FsdpConfig()
megatron: TrainerConfig = MegatronConfig()
