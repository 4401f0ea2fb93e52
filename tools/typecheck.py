"""Checked by mypy (the root pyproject's [tool.mypy]), never run: each trainer config is
assigned to rl-runtime's `TrainerConfig` protocol, each package's `actor_class` to its
`ActorClass` (the actor to `TrainActor`), and the rollout package's launch module to its
`EngineLauncher`, so a signature that drifts from the protocol's fails the type check instead
of a launcher at run time."""

from __future__ import annotations

import rollout_sglang.launch
import trainers_fsdp.build
import trainers_megatron.build
from rl_runtime.protocols import ActorClass, EngineLauncher, TrainerConfig
from trainers_fsdp.config import FsdpConfig
from trainers_megatron.config import MegatronConfig

fsdp: TrainerConfig = FsdpConfig()
megatron: TrainerConfig = MegatronConfig()
fsdp_actor: ActorClass = trainers_fsdp.build.actor_class
megatron_actor: ActorClass = trainers_megatron.build.actor_class
engines: EngineLauncher = rollout_sglang.launch
