"""Checkpoint folders: HF safetensors <-> Megatron per-rank shards, streamed.

A Megatron folder written here uses Megatron-LM's legacy (non-distributed) layout, so
Megatron-LM's ``--load`` also finds it::

    config.json, tokenizer/processor files   copied from the HF folder
    glimpse_megatron.json                    tp, pp, layer split, use_te, format version
    latest_checkpointed_iteration.txt        "release"
    release/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt   {"model": state dict, ...}
    mtp.safetensors                          Qwen3.5's multi-token-prediction head, as read

State-dict keys are those of :class:`~vlm_models.megatron.model.Qwen3VLMegatronModel`. The
MTP head (``mtp.*``, Qwen3.5 checkpoints) is not part of the trained model: its tensors are
kept byte for byte beside the shards and written back with the HF folder. Both
directions hold one output shard (HF) or one rank's shard (Megatron) at a time, and read input
tensors lazily (safetensors ``safe_open``, ``torch.load(mmap=True)``), so the model is never in
memory twice.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig

from vlm_models.megatron.config import text_arch
from vlm_models.megatron.convert import hf_to_megatron_stage, megatron_to_hf_stage
from vlm_models.megatron.file_layout import (
    EXPERT_STACKS,
    from_file_layout,
    is_released_expert_layout,
    per_expert_names,
    split_experts,
    stack_experts,
    to_file_layout,
)
from vlm_models.megatron.name_map import StageLayout, stage_layouts, vision_names_from
from weight_sync.files import save_safetensors

logger = logging.getLogger(__name__)

META_FILE = "glimpse_megatron.json"
MTP_FILE = "mtp.safetensors"
MTP_PREFIX = "mtp."  # Qwen3.5's multi-token-prediction head (transformers ignores it too)
FORMAT_VERSION = 1
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def shard_path(root: Path, tp_rank: int, pp_rank: int, pp_size: int) -> Path:
    """Megatron-LM's legacy path of one rank's shard."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return root / "release" / name / "model_optim_rng.pt"


class SafetensorsReader:
    """Lazy access to the tensors of an HF checkpoint folder (single file or sharded).

    ``reader(name)`` returns the tensor in transformers' in-memory layout (the layout the maps
    and ``load_hf_weights`` use), so ``load_hf_weights(model, reader)`` streams a folder into a
    live model at any TP/PP/EP.
    """

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.arch = text_arch(AutoConfig.from_pretrained(folder))
        # the stacked-expert tensors of the layer being read: the maps ask for each once per
        # local expert, alternating gate_up and down; keeping only the last one rebuilt both
        # stacks for every expert (from per-expert files: 2 x 256 stacks of 256 experts a
        # layer for Qwen3.5-35B-A3B, a start-up that did not finish in 400 s on an H200)
        self._stacks: dict[str, Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files (only safetensors is read)")
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for path in files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                self._where[key] = handle

    def keys(self) -> list[str]:
        return list(self._where)

    def mtp_tensors(self) -> dict[str, Tensor]:
        """The checkpoint's MTP-head tensors (``mtp.*``), unchanged; empty when it has none."""
        return {n: self._where[n].get_tensor(n) for n in self._where if n.startswith(MTP_PREFIX)}  # type: ignore[attr-defined]

    def __call__(self, name: str) -> Tensor:
        if name in self._stacks:
            return self._stacks[name]
        handle = self._where.get(name)
        if handle is not None:
            tensor = from_file_layout(name, handle.get_tensor(name), self.arch)  # type: ignore[attr-defined]
        elif self.per_expert_layout() and name.endswith(EXPERT_STACKS):
            parts = per_expert_names(name, self.arch.num_experts or 0)
            tensor = stack_experts([[self._raw(n) for n in names] for names in parts])
        else:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        if name.endswith(EXPERT_STACKS):
            layer = name.rsplit(".mlp.experts.", 1)[0]
            self._stacks = {n: t for n, t in self._stacks.items() if n.startswith(layer + ".")}
            self._stacks[name] = tensor
        return tensor

    def _raw(self, name: str) -> Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def per_expert_layout(self) -> bool:
        """Whether this folder stores MoE experts one tensor per expert (Qwen3.5-MoE files)."""
        return any(".mlp.experts.0." in n for n in self._where)

    def released_expert_layout(self) -> bool:
        """Whether this folder's MoE experts are in the released (transposed) layout."""
        for name, handle in self._where.items():
            shape = tuple(handle.get_slice(name).get_shape())  # type: ignore[attr-defined]
            if is_released_expert_layout(name, shape, self.arch):
                return True
        return False

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_side_files(src: Path, dst: Path) -> None:
    """Config, tokenizer and processor files (everything but weights and our metadata)."""
    for path in src.iterdir():
        if (
            path.is_file()
            and not path.name.endswith(_WEIGHT_FILES)
            and path.name
            not in (
                META_FILE,
                "latest_checkpointed_iteration.txt",
                "model.safetensors.index.json",
            )
        ):
            shutil.copy2(path, dst / path.name)


def hf_to_megatron_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    use_te: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the Megatron shards of the HF checkpoint in ``hf_dir`` to ``out_dir``."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(hf_dir)
    arch = text_arch(config)
    stages = stage_layouts(
        arch.num_layers,
        pp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = SafetensorsReader(hf_dir)
    vision = vision_names_from(reader.keys())
    released_experts = reader.released_expert_layout()
    per_expert = reader.per_expert_layout()
    mtp = reader.mtp_tensors()
    if mtp:  # not trained here; kept as read, so the HF folder written back has it
        save_safetensors(mtp, out_dir / MTP_FILE, {"format": "pt"})
        logger.info("kept %d MTP-head tensors in %s", len(mtp), out_dir / MTP_FILE)

    def get(name: str) -> Tensor:
        tensor = reader(name)
        return tensor if dtype is None else tensor.to(dtype)

    try:
        for stage in stages:
            for tp_rank in range(tp):
                state = dict(
                    hf_to_megatron_stage(
                        get, arch, stage, tp_rank, tp, vision_names=vision, use_te=use_te
                    )
                )
                path = shard_path(out_dir, tp_rank, stage.pp_rank, pp)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": state, "checkpoint_version": 3.0, "iteration": 0}, path)
                logger.info("wrote %s (%d tensors)", path, len(state))
                del state
    finally:
        reader.close()
    _copy_side_files(hf_dir, out_dir)
    meta = dict(
        format_version=FORMAT_VERSION,
        tp=tp,
        pp=pp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        use_te=use_te,
        released_expert_layout=released_experts,  # written back the same way
        per_expert_layout=per_expert,
    )
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (out_dir / "latest_checkpointed_iteration.txt").write_text("release")
    return out_dir


def read_meta(megatron_dir: Path) -> dict:
    path = megatron_dir / META_FILE
    if not path.exists():
        raise FileNotFoundError(f"{megatron_dir}: no {META_FILE}; not written by this converter")
    return json.loads(path.read_text())


def _iter_hf_tensors(megatron_dir: Path, config: PretrainedConfig) -> Iterator[tuple[str, Tensor]]:
    meta = read_meta(megatron_dir)
    arch = text_arch(config)
    tp, pp = meta["tp"], meta["pp"]
    stages: list[StageLayout] = stage_layouts(
        arch.num_layers,
        pp,
        first_stage_layers=meta.get("first_stage_layers"),
        last_stage_layers=meta.get("last_stage_layers"),
    )
    vision: list[str] = []
    for stage in stages:
        shards = [
            torch.load(
                shard_path(megatron_dir, r, stage.pp_rank, pp), mmap=True, weights_only=True
            )["model"]
            for r in range(tp)
        ]
        if stage.first:
            vision = [n[len("visual.") :] for n in shards[0] if n.startswith("visual.")]

        def get_shards(name: str, shards: list[dict] = shards) -> list[Tensor]:
            return [s[name] for s in shards]

        yield from megatron_to_hf_stage(
            get_shards,
            arch,
            stage,
            vision_names=vision if stage.first else (),
            use_te=meta["use_te"],
        )
        del shards


def _iter_mtp_tensors(megatron_dir: Path) -> Iterator[tuple[str, Tensor]]:
    """The MTP head kept by :func:`hf_to_megatron_checkpoint`, one tensor at a time."""
    path = megatron_dir / MTP_FILE
    if path.exists():
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                yield name, handle.get_tensor(name)


def megatron_to_hf_checkpoint(
    megatron_dir: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 << 30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF safetensors checkpoint (``model-*.safetensors`` + index) from Megatron shards."""
    megatron_dir, out_dir = Path(megatron_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(megatron_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[tuple[Path, list[str]]] = []
    bucket: dict[str, Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal bucket, size
        path = out_dir / f"part-{len(files):05d}.safetensors"
        save_safetensors({k: v.contiguous() for k, v in bucket.items()}, path, {"format": "pt"})
        files.append((path, list(bucket)))
        bucket, size = {}, 0

    meta = read_meta(megatron_dir)
    released = meta.get("released_expert_layout", False)

    def file_tensors() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in _iter_hf_tensors(megatron_dir, config):
            if meta.get("per_expert_layout") and name.endswith(EXPERT_STACKS):
                yield from split_experts(name, tensor)
            else:
                yield name, to_file_layout(name, tensor, released=released)
        yield from _iter_mtp_tensors(megatron_dir)

    for name, tensor in file_tensors():
        tensor = tensor if dtype is None else tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_shard_bytes:
            flush()
        bucket[name] = tensor
        size += nbytes
        total += nbytes
    if bucket:
        flush()
    weight_map = {}
    for i, (path, names) in enumerate(files):
        final = out_dir / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        path.rename(final)
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(megatron_dir, out_dir)
    logger.info("wrote %d tensors in %d files to %s", len(weight_map), len(files), out_dir)
    return out_dir


def load_megatron_checkpoint(model, megatron_dir: str | Path) -> None:
    """Load this rank's shard of a folder written by :func:`hf_to_megatron_checkpoint`."""
    from megatron.core import parallel_state

    megatron_dir = Path(megatron_dir)
    meta = read_meta(megatron_dir)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "Megatron folders hold all experts per shard (ep=1); with expert parallelism load "
            "the HF folder instead: load_hf_weights(model, SafetensorsReader(hf_dir))"
        )
    if (meta["tp"], meta["pp"]) != (tp, pp):
        raise ValueError(
            f"{megatron_dir} holds tp={meta['tp']} pp={meta['pp']} shards but the model runs "
            f"tp={tp} pp={pp}; convert again with those sizes"
        )
    path = shard_path(
        megatron_dir,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        pp,
    )
    state = torch.load(path, mmap=True, weights_only=True)["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"{path}: missing {missing[:8]}, unexpected {unexpected[:8]}")
