"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint folder:

- DCP files: the sharded model and optimizer state (``get_state_dict``, so they reload on any
  world size);
- ``trainer_state_rank{r}.pt``: this rank's step, LR scheduler and RNG states (CPU, CUDA), so
  the next step after a resume draws the same random numbers.

Loading never runs code from the folder: the ``.pt`` files are read with ``weights_only=True``
and DCP's ``.metadata`` (a pickle, which torch's own reader loads unrestricted) through
:class:`SafeFileSystemReader`, which builds only DCP's metadata types.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

logger = logging.getLogger(__name__)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to build something that is not checkpoint data."""


#: What DCP's metadata pickle may build: its own metadata classes and a few plain values.
_SAFE_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata asks for {module}.{name}, which is not checkpoint data; "
            "refusing to load it"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read by an unpickler that builds only DCP's
    metadata types (torch's reader calls ``pickle.load`` on whatever the folder holds)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
) -> None:
    """Save model, optimizer, scheduler, RNG and step to ``path`` (collective)."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = {"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(extra, path / f"trainer_state_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    logger.info("saved checkpoint at step %d to %s", step, path)


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> int:
    """Restore what :func:`save_checkpoint` wrote; returns the step (collective)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    reader = SafeFileSystemReader(str(path))
    reader.read_metadata()  # a hostile folder fails here, with our message, not inside DCP
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra_file = path / f"trainer_state_rank{rank}.pt"
    if not extra_file.exists():  # resumed on more ranks than saved: take rank 0's schedule
        extra_file = path / "trainer_state_rank0.pt"
    extra = torch.load(extra_file, weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    logger.info("loaded checkpoint of step %d from %s", extra["step"], path)
    return int(extra["step"])
