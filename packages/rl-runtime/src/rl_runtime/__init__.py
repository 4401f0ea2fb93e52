"""rl_runtime: the configuration tree, Ray cluster and placement, actor groups, the training
layout, the GRPO and SFT loops, evaluation, logging, checkpoints. It knows the trainer and
engine protocols, never the concrete backends: the apps pick those.

The settings (the config dataclasses) and the errors import here; every other name is imported
from its module on first use (PEP 562 `__getattr__`), so a launcher parses its flags, and
refuses a bad one, without torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

from rl_algos.run_context import ParallelLayout, RunContext, StateBytes
from rl_runtime.checkpoint import ResumeError
from rl_runtime.cluster_config import ClusterConfig
from rl_runtime.config_fields import ConfigError
from rl_runtime.faults import (
    CheckpointFailed,
    LogprobMismatch,
    NonFiniteStop,
    RunStopped,
    WorkerDied,
)
from rl_runtime.loop_config import GrpoLoopConfig
from rl_runtime.parallel import ParallelConfig
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import TrainerConfig
from rl_runtime.run import RunConfig
from rl_runtime.sft_config import SftLoopConfig, WarmupConfig

#: Each public name not imported above, by the module that defines it.
_LAZY: dict[str, tuple[str, ...]] = {
    "rl_runtime.actor_group": ("EngineWorker", "RolloutGroup", "TrainGroup", "TrainWorker"),
    "rl_runtime.checkpoint": ("CheckpointManager", "resume_step"),
    "rl_runtime.cli": ("as_config_error", "user_errors"),
    "rl_runtime.cluster": ("Cluster",),
    "rl_runtime.cluster_config": ("Layout", "layout", "placement_preview"),
    "rl_runtime.config": ("parse_config", "to_dict", "to_json", "validate"),
    "rl_runtime.config_fields": ("choice", "option", "section"),
    "rl_runtime.data": ("PromptPrefetch", "PromptSampler"),
    "rl_runtime.evaluation": ("eval_prompts", "evaluate"),
    "rl_runtime.gc_policy": ("PeriodicGC",),
    "rl_runtime.logprob_guard": ("coarsest_dtype",),
    "rl_runtime.loop": ("GrpoParts", "run_grpo"),
    "rl_runtime.memory": (
        "ColocationPlan",
        "MemoryEstimate",
        "ModelShape",
        "TrainLayout",
        "check_layout",
        "choose_layout",
        "estimate_memory",
        "keep_train_state_on_gpu",
        "plan_colocation",
    ),
    "rl_runtime.metrics": ("RunLogger", "plot_metrics", "read_metrics"),
    "rl_runtime.parallel": (
        "check_parallel",
        "gpu_memory_bytes",
        "host_budget",
        "host_memory_bytes",
        "layout_report",
        "plan_layout",
        "settle",
        "state_estimate",
    ),
    "rl_runtime.placement": ("Placement", "create_placement", "init_ray", "shutdown_ray"),
    "rl_runtime.preflight": ("check_backend", "check_gpus", "check_output_dir", "count_gpus"),
    "rl_runtime.progress": ("setup_logging",),
    "rl_runtime.protocols": ("PromptSource", "RewardFn", "TrainActor"),
    "rl_runtime.rollout_batch": ("ScoredGroups", "build_train_batch"),
    "rl_runtime.run": ("recipe_env_aliases", "write_config"),
    "rl_runtime.sft": ("run_sft", "sft_batch", "sft_warmup", "train_sft"),
    "weight_sync": ("EngineLink", "TransportFactory", "WeightTransport"),
    "weight_sync.object_store": ("ObjectStoreTransport", "RemoteEngine", "object_store"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "CheckpointFailed",
    "ClusterConfig",
    "ConfigError",
    "GrpoLoopConfig",
    "LogprobMismatch",
    "NonFiniteStop",
    "ParallelConfig",
    "ParallelLayout",
    "PreflightError",
    "ResumeError",
    "RunConfig",
    "RunContext",
    "RunStopped",
    "SftLoopConfig",
    "StateBytes",
    "TrainerConfig",
    "WarmupConfig",
    "WorkerDied",
]
__all__ += sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
