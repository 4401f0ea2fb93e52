"""rl_runtime: Ray placement, actor groups, the GRPO and SFT loops, evaluation, logging,
checkpoints. It knows the actor and engine protocols, never the concrete backends."""

from rl_runtime.actor_group import EngineWorker, RolloutGroup, TrainGroup, TrainWorker
from rl_runtime.checkpoint import CheckpointManager, ResumeError, resume_step
from rl_runtime.cli import user_errors
from rl_runtime.config import (
    ConfigError,
    choice,
    option,
    parse_config,
    section,
    to_dict,
    to_json,
    validate,
)
from rl_runtime.data import PromptSampler
from rl_runtime.evaluation import eval_prompts, evaluate
from rl_runtime.faults import CheckpointFailed, NonFiniteStop, RunStopped, WorkerDied
from rl_runtime.gc_policy import PeriodicGC
from rl_runtime.loop import GrpoLoopConfig, GrpoParts, run_grpo
from rl_runtime.memory import (
    MemoryEstimate,
    ModelShape,
    TrainLayout,
    check_layout,
    choose_layout,
    estimate_memory,
)
from rl_runtime.metrics import RunLogger, plot_metrics, read_metrics
from rl_runtime.placement import Placement, create_placement, init_ray, shutdown_ray
from rl_runtime.preflight import PreflightError, check_backend, check_gpus, count_gpus
from rl_runtime.progress import setup_logging
from rl_runtime.protocols import (
    EngineLink,
    PromptSource,
    RewardFn,
    TrainActor,
    TransportFactory,
    WeightTransport,
)
from rl_runtime.rollout_batch import build_train_batch
from rl_runtime.sft import SftLoopConfig, run_sft, sft_batch
from rl_runtime.weight_push import ObjectStoreTransport, RemoteEngine, object_store

__all__ = [
    "CheckpointFailed",
    "CheckpointManager",
    "ConfigError",
    "EngineLink",
    "EngineWorker",
    "GrpoLoopConfig",
    "GrpoParts",
    "MemoryEstimate",
    "ModelShape",
    "NonFiniteStop",
    "ObjectStoreTransport",
    "PeriodicGC",
    "Placement",
    "PreflightError",
    "PromptSampler",
    "PromptSource",
    "RemoteEngine",
    "ResumeError",
    "RewardFn",
    "RolloutGroup",
    "RunLogger",
    "RunStopped",
    "SftLoopConfig",
    "TrainActor",
    "TrainGroup",
    "TrainLayout",
    "TrainWorker",
    "TransportFactory",
    "WeightTransport",
    "WorkerDied",
    "build_train_batch",
    "check_backend",
    "check_gpus",
    "check_layout",
    "choice",
    "choose_layout",
    "count_gpus",
    "create_placement",
    "estimate_memory",
    "eval_prompts",
    "evaluate",
    "init_ray",
    "object_store",
    "option",
    "parse_config",
    "plot_metrics",
    "read_metrics",
    "resume_step",
    "run_grpo",
    "run_sft",
    "section",
    "setup_logging",
    "sft_batch",
    "shutdown_ray",
    "to_dict",
    "to_json",
    "user_errors",
    "validate",
]
