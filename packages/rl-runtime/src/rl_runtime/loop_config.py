"""`GrpoLoopConfig`: the GRPO loop's settings, plain data without torch, so that a launcher
parses (and refuses) them before torch loads; `rl_runtime.loop` runs with them."""

from __future__ import annotations

from dataclasses import dataclass

from rl_runtime.config_fields import ConfigError, option
from rl_runtime.progress import HEARTBEAT_S


def routing_replay_on(setting: str, moe: bool) -> bool:
    """Whether routing replay runs: ``on``/``off`` as given, ``auto`` for an MoE model."""
    return setting == "on" or (setting == "auto" and moe)


@dataclass
class GrpoLoopConfig:
    num_rollout: int = option(300, "training steps (rollouts)", ge=1)
    rollout_batch_size: int = option(64, "prompts per rollout", ge=1)
    n_samples_per_prompt: int = option(
        8, "responses sampled per prompt (the GRPO group; one alone has no advantage)", ge=2
    )
    global_batch_size: int = option(
        512, "samples per optimizer step (must divide rollout batch x samples per prompt)", ge=1
    )
    rollout_temperature: float = option(0.8, "sampling temperature", gt=0)
    rollout_top_p: float = option(1.0, "top-p of sampling", gt=0, le=1)
    rollout_max_response_len: int = option(4096, "max new tokens per response", ge=1)
    std_normalization: bool = option(True, "divide advantages by the group std (off: Dr. GRPO)")
    reward_dtype: str = option(
        "float32",
        "dtype rewards are rounded to",
        choices=("float32", "float16", "bfloat16", "float64"),
    )
    dynamic_sampling: bool = option(False, "drop groups whose rewards are all equal (DAPO)")
    use_ref_logprobs: bool = option(False, "compute reference log-probs (needed for KL)")
    use_rollout_logprobs: bool = option(
        False,
        "train on the engine's log-probs as the old log-probs and skip the trainer's forward "
        "that recomputes them (slime's --use-rollout-logprobs); off: the trainer recomputes "
        "them (docs/guide.md, 'Old log-probs': the measured gap)",
    )
    routing_replay: str = option(
        "auto",
        "MoE models: the trainer routes every token to the experts the engine routed it to "
        "(rollout routing replay, slime's --use-rollout-routing-replay), so that a bf16 "
        "rounding cannot flip a top-k choice between them; auto: on for MoE models",
        choices=("auto", "on", "off"),
    )
    eval_interval: int = option(20, "evaluate every N steps (0: never)", ge=0)
    eval_before_train: bool = option(
        True, "with --eval-interval: evaluate once before the first step too (step 0)"
    )
    eval_max_prompts: int | None = option(None, "evaluate on at most this many prompts", ge=1)
    n_samples_per_eval_prompt: int = option(1, "samples per eval prompt (pass@1 over them)", ge=1)
    eval_temperature: float | None = option(
        None, "eval sampling temperature (default: the rollout's; 0: greedy)", ge=0
    )
    save_interval: int = option(20, "checkpoint every N steps (0: only at the end)", ge=0)
    keep_checkpoints: int = option(2, "how many checkpoints to keep (0: all)", ge=0)
    weight_bucket_mb: int = option(512, "weight sync bucket size (MiB)", ge=1)
    rollout_seed: int = option(1234, "seed of prompt order and sampling", ge=0)
    max_rollout_retries: int = option(
        2, "restarts of a dead rollout engine per rollout before the run stops", ge=0
    )
    max_nonfinite_steps: int = option(
        3, "stop after this many steps in a row with a non-finite loss or gradient (0: never)", ge=0
    )
    logprob_gap_warn: float | None = option(
        None,
        "warn once when the trainer's old log-probs differ from the engine's by more than this "
        "a response token (mean |old - rollout|; default: the compute dtype's band, "
        "docs/reliability.md)",
        gt=0,
    )
    logprob_gap_stop: float | None = option(
        None,
        "stop the run when that gap is above this (default: the compute dtype's band; 0: never)",
        ge=0,
    )
    progress_interval_s: float = option(
        HEARTBEAT_S,
        "while a phase of a step runs, log a line naming it and its time every this many "
        "seconds (0: never)",
        ge=0,
    )
    offload_train: bool | None = option(
        None,
        "colocated: the trainer's weights, gradients and optimizer state go to the host while "
        "the engines generate (off: they stay on the GPU; default: off where the memory "
        "estimate leaves the engine room for a whole rollout beside them, else on)",
    )

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (a learning-rate schedule's length)."""
        per_rollout = self.rollout_batch_size * self.n_samples_per_prompt // self.global_batch_size
        return self.num_rollout * max(1, per_rollout)

    def check(self) -> None:
        """Each rollout splits into whole optimizer steps (the schedule counts them)."""
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples % self.global_batch_size:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} must divide the {samples} samples "
                f"of a rollout (--rollout-batch-size {self.rollout_batch_size} x "
                f"--n-samples-per-prompt {self.n_samples_per_prompt})"
            )
