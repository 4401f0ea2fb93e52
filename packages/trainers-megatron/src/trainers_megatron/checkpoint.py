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
from torch import Tensor

from trainers_megatron.config import MegatronConfig
from trainers_megatron.optim import load_optimizer_state, optimizer_state
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
