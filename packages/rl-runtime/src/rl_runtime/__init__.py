"""rl_runtime: the configuration tree, Ray cluster and placement, actor groups, the training
layout, the GRPO and SFT loops, evaluation, logging, checkpoints. It knows the trainer and
engine protocols, never the concrete backends: the apps pick those."""

from rl_algos.run_context import ParallelLayout, RunContext, StateBytes
from rl_runtime.actor_group import EngineWorker, RolloutGroup, TrainGroup, TrainWorker
from rl_runtime.checkpoint import CheckpointManager, ResumeError, resume_step
from rl_runtime.cli import as_config_error, user_errors
from rl_runtime.cluster import Cluster, ClusterConfig, Layout, layout, placement_preview
from rl_runtime.config import parse_config, to_dict, to_json, validate
from rl_runtime.config_fields import ConfigError, choice, option, section
from rl_runtime.data import PromptPrefetch, PromptSampler
from rl_runtime.evaluation import eval_prompts, evaluate
from rl_runtime.faults import (
    CheckpointFailed,
    LogprobMismatch,
    NonFiniteStop,
    RunStopped,
    WorkerDied,
)
from rl_runtime.gc_policy import PeriodicGC
from rl_runtime.logprob_guard import coarsest_dtype
from rl_runtime.loop import GrpoLoopConfig, GrpoParts, run_grpo
from rl_runtime.memory import (
    ColocationPlan,
    MemoryEstimate,
    ModelShape,
    TrainLayout,
    check_layout,
    choose_layout,
    estimate_memory,
    keep_train_state_on_gpu,
    plan_colocation,
)
from rl_runtime.metrics import RunLogger, plot_metrics, read_metrics
from rl_runtime.parallel import (
    ParallelConfig,
    check_parallel,
    gpu_memory_bytes,
    host_budget,
    host_memory_bytes,
    layout_report,
    plan_layout,
    settle,
    state_estimate,
)
from rl_runtime.placement import Placement, create_placement, init_ray, shutdown_ray
from rl_runtime.preflight import PreflightError, check_backend, check_gpus, count_gpus
from rl_runtime.progress import setup_logging
from rl_runtime.protocols import PromptSource, RewardFn, TrainActor, TrainerConfig
from rl_runtime.rollout_batch import ScoredGroups, build_train_batch
from rl_runtime.run import RunConfig, recipe_env_aliases, write_config
from rl_runtime.sft import SftLoopConfig, WarmupConfig, run_sft, sft_batch, sft_warmup, train_sft
from weight_sync import EngineLink, TransportFactory, WeightTransport
from weight_sync.object_store import ObjectStoreTransport, RemoteEngine, object_store

__all__ = [
    "CheckpointFailed",
    "CheckpointManager",
    "Cluster",
    "ClusterConfig",
    "ColocationPlan",
    "ConfigError",
    "EngineLink",
    "EngineWorker",
    "GrpoLoopConfig",
    "GrpoParts",
    "Layout",
    "LogprobMismatch",
    "MemoryEstimate",
    "ModelShape",
    "NonFiniteStop",
    "ObjectStoreTransport",
    "ParallelConfig",
    "ParallelLayout",
    "PeriodicGC",
    "Placement",
    "PreflightError",
    "PromptPrefetch",
    "PromptSampler",
    "PromptSource",
    "RemoteEngine",
    "ResumeError",
    "RewardFn",
    "RolloutGroup",
    "RunConfig",
    "RunContext",
    "RunLogger",
    "RunStopped",
    "ScoredGroups",
    "SftLoopConfig",
    "StateBytes",
    "TrainActor",
    "TrainGroup",
    "TrainLayout",
    "TrainWorker",
    "TrainerConfig",
    "TransportFactory",
    "WarmupConfig",
    "WeightTransport",
    "WorkerDied",
    "as_config_error",
    "build_train_batch",
    "check_backend",
    "check_gpus",
    "check_layout",
    "check_parallel",
    "choice",
    "choose_layout",
    "coarsest_dtype",
    "count_gpus",
    "create_placement",
    "estimate_memory",
    "eval_prompts",
    "evaluate",
    "gpu_memory_bytes",
    "host_budget",
    "host_memory_bytes",
    "init_ray",
    "keep_train_state_on_gpu",
    "layout",
    "layout_report",
    "object_store",
    "option",
    "parse_config",
    "placement_preview",
    "plan_colocation",
    "plan_layout",
    "plot_metrics",
    "read_metrics",
    "recipe_env_aliases",
    "resume_step",
    "run_grpo",
    "run_sft",
    "section",
    "settle",
    "setup_logging",
    "sft_batch",
    "sft_warmup",
    "shutdown_ray",
    "state_estimate",
    "to_dict",
    "to_json",
    "train_sft",
    "user_errors",
    "validate",
    "write_config",
]
