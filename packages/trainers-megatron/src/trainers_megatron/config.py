"""The Megatron actor's one config: model source, parallelism, precision, batching, optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rl_algos import GrpoLossConfig


@dataclass
class MegatronConfig:
    """Everything :class:`~trainers_megatron.MegatronActor` needs.

    ``model`` is a preset name (random init from ``seed``), an HF folder with safetensors
    (streamed into the shards), a hub id (downloaded first; the launchers pass the folder) or a
    config object (random init). Anything else is an error, never a random model. Dtypes are
    names.
    """

    model: Any = "qwen3-vl-tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    tp: int = 1  # tensor parallel
    sp: bool = False  # sequence parallel (needs tp > 1)
    pp: int = 1  # pipeline parallel: stages, run by megatron-core's 1F1B schedule
    # decoder layers on the first pipeline stage (None: an even split, or the fewest that hold
    # every deepstack layer when the even split does not)
    pipeline_first_stage_layers: int | None = None
    ep: int = 1  # expert parallel (MoE): experts split over this many data-parallel ranks
    # megatron-core's distributed optimizer: float32 masters and AdamW moments sharded over the
    # data-parallel ranks (False: every rank holds them whole)
    distributed_optimizer: bool = True
    param_dtype: str | None = None  # compute dtype; None: bfloat16 on CUDA, float32 on CPU
    # activation recomputation (TransformerConfig.recompute_granularity): "full" recomputes
    # whole decoder layers (recompute_method / recompute_num_layers say which), "selective"
    # the parts in recompute_modules (None: megatron-core's default, core attention);
    # True / False mean "full" / "none"
    recompute: Literal["none", "selective", "full"] | bool = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] | None = None
    # torch.compile each decoder layer (one function shared by all). Off by default: on the
    # H200 the first compiled step had not finished after 3.5 min (2026-12-01), not yet
    # understood; None: on CUDA for dense models (compiles_by_default)
    compile: bool | None = False
    reference_model: bool = False  # keep a frozen copy of the initial weights (KL penalty)
    max_tokens_per_gpu: int = 16384  # micro-batch token budget (packed THD sequences)
    temperature: float = 1.0  # the rollout's sampling temperature, for log-probs
    grpo: GrpoLossConfig = field(default_factory=GrpoLossConfig)
    sft_loss_agg_mode: str = "token-mean"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01  # matrices only (norms, biases: none)
    max_grad_norm: float = 1.0  # <= 0: report the norm, do not clip
    lr_schedule: str = "constant"  # "constant" | "cosine" (megatron-core's scheduler)
    warmup_steps: int = 0  # linear warmup from 0 to lr over this many optimizer steps
    total_steps: int | None = None  # cosine: optimizer steps to decay over (warmup included)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    export_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens_per_gpu <= 0:
            raise ValueError(f"max_tokens_per_gpu must be positive, got {self.max_tokens_per_gpu}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.sp and self.tp < 2:
            raise ValueError("sp=True (sequence parallel) needs tp > 1")
        if min(self.tp, self.pp, self.ep) < 1:
            raise ValueError(f"tp, pp and ep must be >= 1, got {self.tp}, {self.pp}, {self.ep}")
        if isinstance(self.recompute, bool):
            self.recompute = "full" if self.recompute else "none"
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(
                f"recompute must be 'none', 'selective' or 'full', got {self.recompute!r}"
            )
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(
                f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}"
            )
        if self.lr_schedule == "cosine" and not self.total_steps:
            raise ValueError("lr_schedule='cosine' needs total_steps")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("warmup_steps must be >= 0 and min_lr_ratio within [0, 1]")
