"""`GrpoLossConfig`: the GRPO loss's settings, plain data without torch, so that a launcher
parses (and refuses) them before torch loads; :mod:`rl_algos.losses` computes with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlType = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl"]


@dataclass
class GrpoLossConfig:
    """Settings of :func:`grpo_loss` (defaults: DAPO-style clip-higher, token-mean, no KL).
    Fields with a help text are a launcher's settings (`rl_runtime.parse_config`)."""

    eps_clip: float = field(  # lower clip: ratio >= 1 - eps_clip
        default=0.2, metadata={"help": "PPO clip range (lower)", "gt": 0, "lt": 1}
    )
    eps_clip_high: float = field(  # upper clip: ratio <= 1 + eps_clip_high ("clip-higher")
        default=0.28, metadata={"help": "PPO clip range (upper, clip-higher)", "gt": 0}
    )
    dual_clip_c: float | None = None  # dual clip for negative advantages (e.g. 3.0); > 1
    loss_agg_mode: LossAggMode = field(default="token-mean", metadata={"help": "loss aggregation"})
    norm_length: float | None = None  # seq-mean-token-sum-norm constant (max response length)
    kl_coef: float = field(  # KL-to-reference loss weight (needs ref_logprobs when > 0)
        default=0.0,
        metadata={"help": "KL penalty coefficient (0: no KL, no reference model)", "ge": 0},
    )
    kl_type: KlType = field(default="low_var_kl", metadata={"help": "KL estimator"})
    entropy_coef: float = field(  # entropy bonus weight (needs entropy when > 0)
        default=0.0, metadata={"help": "entropy bonus coefficient"}
    )
    use_tis: bool = field(  # rollout -> trainer (needs rollout_logprobs)
        default=False,
        metadata={"help": "truncated importance sampling against the rollout log-probs"},
    )
    tis_cap: float = 2.0  # upper bound of the TIS weight
    gspo: bool = False  # sequence-level ratio (GSPO); pair with small eps and seq-mean-token-mean

    def __post_init__(self) -> None:
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.eps_clip < 0 or self.eps_clip_high < 0:
            raise ValueError("eps_clip and eps_clip_high must be >= 0")
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")
