"""The Megatron actor's folders: its own checkpoints (each rank's shard, resumed only on the
same layout) and the HF export that ``from_pretrained`` and the rollout engines load. Apart
from the actor because they only read its state: the step's code does not depend on them.
What they read of it is :class:`CheckpointedActor`; the actor imports this module, never the
other way."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import MegatronOptimizer
from torch import Tensor

from trainers_megatron.config import MegatronConfig
from trainers_megatron.optim import fuse_torch_adam, hybrid_optimizer, optimizers
from vlm_models.megatron import SafetensorsReader
from vlm_models.presets import PRESETS
from weight_sync.files import save_safetensors


class CheckpointedActor(Protocol):
    """What the folders read of a `trainers_megatron.actor.MegatronActor`, and the step a
    resume sets."""

    rank: int
    config: MegatronConfig
    hf_config: Any  # the transformers config, saved with the export
    module: Any  # the stage's Megatron model
    optimizer: Any
    scheduler: Any
    step: int

    def iter_hf_weights(
        self, bucket_bytes: int = 1 << 30, *, device: str | None = "cpu", wire: bool = True
    ) -> Iterator[list[tuple[str, Tensor]]]: ...


#: What a checkpoint folder that does not record a field was saved with.
DEFAULT_LAYOUT: dict[str, Any] = {
    "world_size": 1,
    "tp": 1,
    "cp": 1,
    "pp": 1,
    "ep": 1,
    "distributed_optimizer": False,
}


def layout_of(config: MegatronConfig) -> dict[str, Any]:
    """The layout a checkpoint is saved with and must be resumed on."""
    return {
        "world_size": dist.get_world_size(),
        "tp": config.tp,
        "cp": config.cp,
        "pp": config.pp,
        "ep": config.ep,
        "distributed_optimizer": config.distributed_optimizer,
    }


def export_hf(actor: CheckpointedActor, path: str | os.PathLike) -> None:
    """An HF folder (config + safetensors) that ``from_pretrained`` loads; rank 0 writes.
    A Qwen3.5 MTP head of the source folder (not trained here) is copied along as read."""
    path = Path(path)
    tensors: dict[str, Tensor] = {}
    for bucket in actor.iter_hf_weights(wire=False):  # the layout it wrote before
        if actor.rank == 0:
            tensors.update(bucket)
    source = actor.config.model
    if actor.rank == 0 and isinstance(source, str) and source not in PRESETS:
        with SafetensorsReader(source) as reader:
            tensors.update(reader.mtp_tensors())
    if actor.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        actor.hf_config.save_pretrained(path)
        save_safetensors(tensors, path / "model.safetensors", {"format": "pt"})
    dist.barrier()


def save_checkpoint(actor: CheckpointedActor, path: str | os.PathLike) -> None:
    """Each rank's shard, optimizer state (this rank's shard of the masters and moments
    under the distributed optimizer), LR schedule and step (same layout to resume)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "model": actor.module.state_dict(),
        "optimizer": optimizer_state(actor.optimizer),
        "scheduler": actor.scheduler.state_dict(),
        "step": actor.step,
        "rng": torch.get_rng_state(),
    }
    torch.save(state, path / f"rank{actor.rank:05d}.pt")
    if actor.rank == 0:
        meta = {**layout_of(actor.config), "sp": actor.config.sp}
        (path / "actor.json").write_text(json.dumps(meta) + "\n")
    dist.barrier()


def load_checkpoint(actor: CheckpointedActor, path: str | os.PathLike) -> None:
    """Resume from :func:`save_checkpoint`'s folder (same world size and layout)."""
    path = Path(path)
    meta = json.loads((path / "actor.json").read_text())
    saved = {k: meta.get(k, default) for k, default in DEFAULT_LAYOUT.items()}
    if saved != layout_of(actor.config):
        raise ValueError(f"{path} was saved with {saved}; this run has {layout_of(actor.config)}")
    state = torch.load(path / f"rank{actor.rank:05d}.pt", weights_only=True)  # no code runs
    # the optimizer first: megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload)
    # initialises a fresh state by a step on random gradients, which writes the weights
    load_optimizer_state(actor.optimizer, state["optimizer"])
    actor.module.load_state_dict(state["model"], strict=False)
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.step = state["step"]
    torch.set_rng_state(state["rng"])


def optimizer_state(optimizer: MegatronOptimizer) -> list[dict[str, Any]] | None:
    """This rank's optimizer state, one entry per chained optimizer (None before any update:
    nothing to keep). Under the distributed optimizer each entry carries this rank's shards of
    the master weights and moments in megatron-core's ``dp_reshardable`` form (no
    communication; resumes with the same layout), which its ``load_state_dict`` reads back."""
    opts = optimizers(optimizer)
    if not any(_updated(opt.optimizer) for opt in opts):
        return None
    out = []
    for opt in opts:
        entry = opt.state_dict()
        for group in _saved_groups(entry):
            for key in [k for k, v in group.items() if isinstance(v, type)]:
                del group[key]  # the hybrid optimizer's classes: not data (weights_only loads)
        if hasattr(opt, "get_parameter_state_dp_reshardable"):
            entry["param_state"] = _mark_no_padding(opt.get_parameter_state_dp_reshardable())
            entry["param_state_sharding_type"] = "dp_reshardable"
        out.append(entry)
    return out


def _updated(inner: Any) -> bool:
    """Whether ``inner`` (a chained optimizer's torch or hybrid optimizer) has stepped: its
    state is made before the first step (:func:`init_adam_state`), with step counts of 0."""
    if inner is None:
        return False
    first: dict[str, Any] = next(iter(inner.state.values()), {})
    return "step" in first and float(first["step"]) > 0


def _saved_groups(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The inner optimizer's param groups in one optimizer's state dict (the distributed and
    mixed-precision optimizers nest it under ``optimizer``)."""
    return entry.get("optimizer", entry).get("param_groups", [])


def _mark_no_padding(state: dict[Any, Any]) -> dict[Any, Any]:
    """megatron-core 0.16.1's ``load_parameter_state_from_dp_reshardable`` skips entries whose
    ``padding`` is true and reads that key from every entry, but
    ``get_parameter_state_dp_reshardable`` writes no such key (only the dist-checkpointing
    path, ``sharded_param_state_dp_reshardable``, adds it, False for real parameters): add it."""
    for key, by_dtype in state.items():
        if isinstance(key, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return state


@torch.no_grad()  # float32 masters are views of the (leaf) parameters, copied in place
def load_optimizer_state(optimizer: MegatronOptimizer, saved: list[dict[str, Any]] | None) -> None:
    """Inverse of :func:`optimizer_state` (same layout and world size)."""
    if saved is None:
        return
    opts = optimizers(optimizer)
    if len(opts) != len(saved):
        raise ValueError(f"checkpoint has {len(saved)} optimizer(s), this model {len(opts)}")
    for opt, entry in zip(opts, saved, strict=True):
        live = opt.optimizer.param_groups if opt.optimizer is not None else []
        for group, mine in zip(_saved_groups(entry), live, strict=False):
            group.update({k: v for k, v in mine.items() if isinstance(v, type)})
        opt.load_state_dict(entry)
        _unshare_steps(opt)
        hybrid = hybrid_optimizer(opt)
        if hybrid is not None:
            _restore_hybrid_masters(hybrid)
    fuse_torch_adam(optimizer)  # loading put the saved (host) step counters back


def _restore_hybrid_masters(hybrid: Any) -> None:
    """Put a loaded HybridDeviceOptimizer's masters where it steps them.

    megatron-core 0.16.1 loads the distributed optimizer's parameter state after the inner
    optimizer's state dict, by replacing each parameter's ``master_param`` entry; the hybrid
    optimizer copies that entry into the float32 tensors it steps only in its own load hook,
    which ran before. Its ``_update_fp32_params_by_new_state`` copies them now. Step counters
    move to their parameter's device (torch's fused AdamW keeps them there)."""
    hybrid._update_fp32_params_by_new_state()
    for sub in hybrid.sub_optimizers:
        for group in sub.param_groups:
            for p in group["params"]:
                step = sub.state.get(p, {}).get("step")
                if isinstance(step, Tensor) and step.device != p.device:
                    sub.state[p]["step"] = step.to(p.device, torch.float32)


def _unshare_steps(opt: MegatronOptimizer) -> None:
    """Give every parameter its own AdamW ``step`` tensor again.

    Without Apex or Transformer Engine, megatron-core 0.16.1's
    ``DistributedOptimizer.load_state_dict`` puts one ``step`` tensor object into every
    parameter's state; torch's AdamW then adds 1 to it once per parameter in each step, and the
    bias corrections after a resume are wrong.
    """
    inner = getattr(opt, "optimizer", None)
    if inner is None:
        return
    for state in inner.state.values():
        if isinstance(state.get("step"), Tensor):
            state["step"] = state["step"].clone()
