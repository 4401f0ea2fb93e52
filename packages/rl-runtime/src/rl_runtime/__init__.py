"""rl_runtime: Ray placement, actor groups, the GRPO and SFT loops, evaluation, logging,
checkpoints. It knows the actor and engine protocols, never the concrete backends."""

from rl_runtime.actor_group import EngineWorker, RolloutGroup, TrainGroup, TrainWorker
from rl_runtime.checkpoint import CheckpointManager
from rl_runtime.config import ConfigError, option, parse_config, to_dict, to_json
from rl_runtime.data import PromptSampler
from rl_runtime.evaluation import eval_prompts, evaluate
from rl_runtime.faults import CheckpointFailed, NonFiniteStop, RunStopped, WorkerDied
from rl_runtime.gc_policy import PeriodicGC
from rl_runtime.loop import GrpoLoopConfig, GrpoParts, run_grpo
from rl_runtime.metrics import RunLogger, plot_metrics, read_metrics
from rl_runtime.placement import Placement, create_placement, init_ray
from rl_runtime.preflight import PreflightError, check_backend, check_gpus, count_gpus
from rl_runtime.progress import setup_logging
from rl_runtime.protocols import PromptSource, RewardFn, TrainActor
from rl_runtime.rollout_batch import build_train_batch
from rl_runtime.sft import SftLoopConfig, run_sft, sft_batch

__all__ = [
    "CheckpointFailed",
    "CheckpointManager",
    "ConfigError",
    "EngineWorker",
    "GrpoLoopConfig",
    "GrpoParts",
    "NonFiniteStop",
    "PeriodicGC",
    "Placement",
    "PreflightError",
    "PromptSampler",
    "PromptSource",
    "RewardFn",
    "RolloutGroup",
    "RunLogger",
    "RunStopped",
    "SftLoopConfig",
    "TrainActor",
    "TrainGroup",
    "TrainWorker",
    "WorkerDied",
    "build_train_batch",
    "check_backend",
    "check_gpus",
    "count_gpus",
    "create_placement",
    "eval_prompts",
    "evaluate",
    "init_ray",
    "option",
    "parse_config",
    "plot_metrics",
    "read_metrics",
    "run_grpo",
    "run_sft",
    "setup_logging",
    "sft_batch",
    "to_dict",
    "to_json",
]
