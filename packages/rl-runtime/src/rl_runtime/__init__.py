"""rl_runtime: the configuration tree, Ray cluster and placement, actor groups, the training
layout, the GRPO and SFT loops, evaluation, logging, checkpoints. It knows the trainer and
engine protocols, never the concrete backends: the apps pick those.

The settings (the config dataclasses) and the errors import here; every other name is imported
from its module on first use (`lazy_loader.attach`, PEP 562), so a launcher parses its flags, and
refuses a bad one, without torch or Ray.
"""

from __future__ import annotations

import lazy_loader

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
from rl_runtime.parallel_config import ParallelConfig
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import TrainerConfig
from rl_runtime.run import RunConfig
from rl_runtime.sft_config import SftLoopConfig, WarmupConfig

# every public name not imported above is imported from its module on first use
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "actor_group": ["RolloutGroup", "TrainGroup"],
        "checkpoint": ["CheckpointManager", "check_resume", "resume_step"],
        "cli": ["as_config_error", "user_errors"],
        "cluster": ["Cluster", "placement_preview"],
        "cluster_config": ["Layout", "layout"],
        "colocation": [
            "ColocationPlan",
            "engine_cache",
            "keep_train_state_on_gpu",
            "plan_colocation",
        ],
        "config": ["parse_config", "to_dict", "to_json", "validate"],
        "config_fields": ["choice", "option", "section"],
        "data": ["PromptPrefetch", "PromptSampler"],
        "evaluation": ["eval_prompts", "evaluate"],
        "gc_policy": ["PeriodicGC"],
        "logprob_guard": ["coarsest_dtype"],
        "loop": ["GrpoParts", "run_grpo"],
        "memory": [
            "MemoryEstimate",
            "ModelShape",
            "TrainLayout",
            "check_layout",
            "choose_layout",
            "estimate_memory",
        ],
        "metrics": ["RunLogger", "plot_metrics", "read_metrics"],
        "parallel": [
            "gpu_memory_bytes",
            "host_budget",
            "host_memory_bytes",
            "layout_report",
            "plan_layout",
            "settle",
            "state_estimate",
        ],
        "parallel_config": ["check_parallel"],
        "placement": ["Placement", "create_placement", "init_ray", "shutdown_ray"],
        "preflight": ["check_backend", "check_gpus", "check_output_dir", "count_gpus"],
        "progress": ["setup_logging"],
        "protocols": ["ActorClass", "PromptSource", "RewardFn", "TrainActor"],
        "rollout_batch": ["ScoredGroups", "build_train_batch"],
        "run": ["recipe_env_aliases", "write_config"],
        "sft": ["run_sft", "sft_batch", "sft_warmup", "train_sft"],
        "workers": ["EngineWorker", "TrainWorker"],
    },
)
__all__ += [
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
