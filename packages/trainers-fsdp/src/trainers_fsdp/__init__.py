"""trainers_fsdp: the FSDP2 actor for GRPO and SFT on vision-language models.

``FsdpActor(FsdpConfig(...))`` implements the trainer protocol of ``docs/architecture.md``:
``compute_logprobs``, ``train_step``, ``iter_hf_weights``, ``save_checkpoint`` /
``load_checkpoint`` / ``export_hf`` and ``offload`` / ``onload``. The parallelism is applied to
a plain transformers model by the small functions of :mod:`trainers_fsdp.parallelize`.
"""

from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.attention import PACKED_ATTENTION, PackedSeqInfo, register_packed_attention
from trainers_fsdp.config import FsdpConfig, OptimConfig
from trainers_fsdp.distributed import build_mesh, init_distributed, resolve_device
from trainers_fsdp.master import MasterWeights
from trainers_fsdp.microbatch import plan_micro_batches
from trainers_fsdp.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_lambda
from trainers_fsdp.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    mixed_precision_policy,
    shard_units,
)
from trainers_fsdp.synthetic import TINY_OVERRIDES, synthetic_batch

__all__ = [
    "PACKED_ATTENTION",
    "TINY_OVERRIDES",
    "FsdpActor",
    "FsdpConfig",
    "MasterWeights",
    "OptimConfig",
    "PackedSeqInfo",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "build_mesh",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
    "init_distributed",
    "lr_lambda",
    "mixed_precision_policy",
    "plan_micro_batches",
    "register_packed_attention",
    "resolve_device",
    "shard_units",
    "synthetic_batch",
]
