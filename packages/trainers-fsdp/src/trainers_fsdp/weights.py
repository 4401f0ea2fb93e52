"""Full HF-named tensors from a sharded model: weight sync buckets and HF-folder export."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from vlm_models.weights import to_checkpoint_layout, to_wire_layout
from weight_sync import iter_weight_buckets

logger = logging.getLogger(__name__)


def _unwrapped_class_name(model: nn.Module) -> str:
    """``Qwen3VLForConditionalGeneration`` for ``FSDPQwen3VLForConditionalGeneration``."""
    for cls in type(model).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def iter_full_tensors(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    state: dict[str, Tensor] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` for every parameter (tied ones once, under the checkpoint's name)
    and persistent buffer, gathered one at a time. Collective: every rank must iterate.
    ``state`` replaces ``model.state_dict()`` (the master weights of a one-rank actor)."""
    for name, tensor in (model.state_dict() if state is None else state).items():
        if name in _tied_names(model):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name, full.detach().to(device=device, dtype=dtype or full.dtype)


def _tied_names(model: nn.Module) -> set[str]:
    """Names a checkpoint leaves out because they share storage with another (``lm_head.weight``
    when embeddings are tied)."""
    config = getattr(model, "config", None)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    text = getattr(config, "text_config", config)
    if not (
        getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)
    ):
        return set()
    return set(tied) if isinstance(tied, dict) else set(tied or ())


def iter_hf_weight_buckets(
    model: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    device="cpu",
    state: dict[str, Tensor] | None = None,
    *,
    wire: bool = True,
) -> Iterator[list[tuple[str, Tensor]]]:
    """Size-bounded buckets of full HF-named tensors in the wire layout of weight sync, or
    (``wire=False``, for an HF folder) in the layout ``save_pretrained`` writes."""
    yield from iter_weight_buckets(
        iter_full_tensors(model, dtype, device, state),
        bucket_bytes,
        convert=functools.partial(to_wire_layout if wire else to_checkpoint_layout, model),
    )


def export_hf_folder(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    shard_bytes: int = 4 << 30,
    state: dict[str, Tensor] | None = None,
) -> None:
    """Write an HF folder (``config.json`` + sharded safetensors + index) that
    ``from_pretrained`` loads. Collective; rank 0 writes."""
    from weight_sync.files import save_safetensors

    out = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    files: list[tuple[str, list[str]]] = []
    for i, bucket in enumerate(
        iter_hf_weight_buckets(model, shard_bytes, dtype, state=state, wire=False)
    ):
        if rank != 0:
            continue
        name = f"model-{i + 1:05d}.safetensors"
        save_safetensors({k: v.contiguous() for k, v in bucket}, out / name, {"format": "pt"})
        files.append((name, [k for k, _ in bucket]))
    if rank == 0:
        total = len(files)
        weight_map = {}
        for i, (name, keys) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (out / name).rename(out / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = model.config
        config.architectures = [_unwrapped_class_name(model)]
        saved_dtype = getattr(config, "dtype", None)
        config.dtype = dtype
        config.save_pretrained(out)
        config.dtype = saved_dtype
        logger.info("exported %d tensors in %d file(s) to %s", len(weight_map), total, out)
    if dist.is_initialized():
        dist.barrier()
