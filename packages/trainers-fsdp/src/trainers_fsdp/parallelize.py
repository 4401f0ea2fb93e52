"""Parallelism applied to a plain transformers model by small functions (torchtitan style).

Order matters and follows torchtitan: activation checkpointing, then compile, then FSDP, each
on the same units: the classes named in the model's ``_no_split_modules`` (for Qwen3-VL the
text decoder layers and the vision blocks), with the root sharded last so it owns what is left
(embeddings, final norm, LM head, patch embedding, mergers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

logger = logging.getLogger(__name__)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP wraps one by one, from the model's declared ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules to shard by")
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(f"none of {sorted(names)} found in {type(model).__name__}")
    return units


def mixed_precision_policy(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype = torch.float32
) -> MixedPrecisionPolicy:
    """Compute in ``param_dtype`` (None: the stored dtype), reduce gradients in ``reduce_dtype``.

    The sharded parameters, and so the optimizer's master weights, keep their stored float32.
    """
    return MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        output_dtype=None,
        cast_forward_inputs=True,
    )


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    shard_layers: bool = True,
) -> nn.Module:
    """``fully_shard`` every unit of :func:`shard_units`, then the root. Returns ``model``.

    The root is never resharded after forward: its parameters (embeddings, LM head) are needed
    again at the start of backward. ``cpu_offload`` keeps the sharded parameters in pinned CPU
    memory and gathers them to the GPU per unit (used for the idle reference model).

    ``shard_layers=False`` shards the root only: one all-gather (with the bf16 cast) and one
    reduce-scatter per step instead of one per layer. On a single rank with
    ``reshard_after_forward=False`` every layer's parameters stay gathered anyway, so per-layer
    units only add hook and copy overhead (about 4 hooks and 2 collectives per layer per step);
    the cost is that the bf16 gradients of the whole model live until the end of backward.
    """
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    units = shard_units(model) if shard_layers else []
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    logger.info(
        "FSDP: %d units (%s) + root over %d rank(s)",
        len(units),
        ", ".join(sorted({type(u).__name__ for u in units})),
        mesh.size(),
    )
    return model


def apply_ac(model: nn.Module) -> nn.Module:
    """Activation checkpointing of every decoder layer / vision block (non-reentrant).

    Uses transformers' own ``GradientCheckpointingLayer`` switch, which keeps parameter names
    (a checkpoint wrapper module would add ``_checkpoint_wrapped_module`` to every key).
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    return model


# Model types compiled unless told otherwise: their decoder layers and vision blocks trace
# without graph breaks, and the 2B step on an H200 ran 1.44x the eager one (docs/performance.md).
# MoE layers (data-dependent expert routing) and Qwen3.5's linear attention are compiled only
# when asked.
COMPILE_BY_DEFAULT = ("qwen3_vl",)


def compile_by_default(device: torch.device, config) -> bool:
    """Whether ``FsdpConfig.compile=None`` compiles: on CUDA, for :data:`COMPILE_BY_DEFAULT`."""
    return device.type == "cuda" and getattr(config, "model_type", None) in COMPILE_BY_DEFAULT


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """``torch.compile`` each unit in place (its ``forward``), keeping module names unchanged.

    ``backend="aot_eager"`` traces the same graphs (dynamo and AOTAutograd) without generating
    kernels: what the CPU tests use, where inductor's C++ build takes minutes."""
    for unit in shard_units(model):
        unit.compile(dynamic=True, backend=backend)
    logger.info("compiled %d units", len(shard_units(model)))
    return model
