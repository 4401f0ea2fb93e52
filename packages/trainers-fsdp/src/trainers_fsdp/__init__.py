"""trainers_fsdp: the FSDP2 actor for GRPO and SFT on vision-language models.

``FsdpActor(FsdpConfig(...))`` implements the trainer protocol of ``docs/architecture.md``:
``compute_logprobs``, ``train_step``, ``iter_hf_weights``, ``save_checkpoint`` /
``load_checkpoint`` / ``export_hf`` and ``offload`` / ``onload``. The parallelism is applied to
a plain transformers model by the small functions of :mod:`trainers_fsdp.parallelize`.

`FsdpConfig` and `OptimConfig` import at once; every other name loads its module on first
use (torch.distributed, the model code: seconds), so a launcher parses its flags without them.
"""

import importlib
from typing import Any

from trainers_fsdp.config import FsdpConfig, OptimConfig

_EXPORTS: dict[str, tuple[str, ...]] = {
    "actor": ("FsdpActor",),
    "attention": (
        "PACKED_ATTENTION",
        "PackedSeqInfo",
        "register_packed_attention",
    ),
    "distributed": (
        "build_mesh",
        "init_distributed",
        "resolve_device",
    ),
    "master": ("MasterWeights",),
    "microbatch": ("plan_micro_batches",),
    "optim": (
        "build_optimizer",
        "build_scheduler",
        "clip_grad_norm",
        "lr_lambda",
    ),
    "parallelize": (
        "apply_ac",
        "apply_compile",
        "apply_fsdp",
        "mixed_precision_policy",
        "shard_units",
    ),
    "synthetic": (
        "TINY_OVERRIDES",
        "synthetic_batch",
    ),
}
_LAZY = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name of `_EXPORTS`, imported once; afterwards a plain attribute."""
    module = _LAZY.get(name)
    if module is None:
        if name in globals():  # loaded by another thread meanwhile
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    _LAZY.pop(name, None)
    return value


__all__ = ["FsdpConfig", "OptimConfig", *_LAZY]
