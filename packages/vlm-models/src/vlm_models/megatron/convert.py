"""HF <-> Megatron weights for Qwen3-VL and Qwen3.5: fusion and tensor-parallel splits, per
parameter and streamed per pipeline stage.

Everything here is pure tensor bookkeeping (no process groups), so it serves the offline
converters in ``tools/`` and the live export alike. Which Megatron parameter of a stage is made
of which HF tensors is the name map's (:mod:`vlm_models.megatron.name_map`: one
:class:`~vlm_models.megatron.name_map.ParamMap` each); its kind says how :func:`shard` builds
one tensor-parallel rank's part of it and :func:`unshard` takes the parts back:

=============  =================================================================  ==========
kind           HF tensors -> one Megatron tensor                                  TP split
=============  =================================================================  ==========
``replicated`` one tensor, unchanged (norms, the vision tower, the router)        none
``row``        one tensor (embedding, ``lm_head``)                                dim 0
``col``        one tensor (``o_proj``, ``down_proj``)                             dim 1
``qkv``        q, k, v fused per query group: ``[g0: q.. k v][g1: q.. k v]...``   dim 0
               (Qwen3.5: ``[g0: q.. gate.. k v]...``, the output gate from
               ``q_proj``'s per-head ``[q_h; gate_h]`` rows)
``gate_up``    gate and up, each split over TP, then ``[gate_r; up_r]``           dim 0
``gdn_in``     Qwen3.5's ``in_proj_qkv`` (``[q; k; v]``), ``in_proj_z/b/a``: each  dim 0
               of q, k, v, z, b, a split over TP, ``[q_r k_r v_r z_r b_r a_r]``
``gdn_conv``   the gated delta net's ``conv1d`` (channels ``[q; k; v]``): each     dim 0
               split over TP, ``[q_r k_r v_r]``
``expert_*``   one expert's slice of HF's stacked ``gate_up_proj`` (``[E, 2I,     expert TP
               H]``, gate rows first) or ``down_proj`` (``[E, H, I]``), then
               split as ``gate_up`` / ``col``
=============  =================================================================  ==========

HF names and shapes are those of the in-memory transformers model (its ``state_dict()``); how
files store the stacked experts is :mod:`vlm_models.megatron.file_layout`'s. The round trip is
exact: only views, splits and concatenations, never arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from vlm_models.megatron.config import TextArch
from vlm_models.megatron.name_map import (
    ParamMap,
    StageLayout,
    stage_layouts,
    stage_param_maps,
    vision_names_from,
)


def _check(name: str, size: int, parts: int) -> None:
    if size % parts:
        raise ValueError(f"{name}: size {size} does not split into {parts} tensor-parallel parts")


def shard(
    pmap: ParamMap, hf_tensors: list[Tensor], arch: TextArch, tp_rank: int, tp_size: int
) -> Tensor:
    """The ``tp_rank`` part of Megatron parameter ``pmap`` built from its HF tensors."""
    kind = pmap.kind
    if kind == "replicated":
        return hf_tensors[0]
    if kind.startswith("expert_"):
        sliced = hf_tensors[0][pmap.expert]
        kind = kind.removeprefix("expert_")
        hf_tensors = list(sliced.chunk(2)) if kind == "gate_up" else [sliced]
    if kind in ("row", "col"):
        dim = 0 if kind == "row" else 1
        (t,) = hf_tensors
        _check(pmap.megatron, t.shape[dim], tp_size)
        return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()
    if kind == "gate_up":
        gate, up = hf_tensors
        _check(pmap.megatron, gate.shape[0], tp_size)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]).contiguous()
    if kind == "qkv":
        return fuse_qkv(*hf_tensors, arch).chunk(tp_size)[tp_rank].contiguous()
    if kind in ("gdn_in", "gdn_conv"):
        parts = torch.cat(hf_tensors).split(_gdn_sections(arch, kind))
        for name, part in zip(("q", "k", "v", "z", "b", "a"), parts, strict=False):
            _check(f"{pmap.megatron} ({name})", part.shape[0], tp_size)
        return torch.cat([p.chunk(tp_size)[tp_rank] for p in parts]).contiguous()
    raise ValueError(f"unknown kind {kind!r}")


def _gdn_sections(arch: TextArch, kind: str) -> list[int]:
    """Row counts of the gated delta net's fused tensors: q, k, v (conv), then z, b, a."""
    qk, v, heads = arch.linear_qk_dim, arch.linear_v_dim, arch.linear_num_value_heads or 0
    return [qk, qk, v] if kind == "gdn_conv" else [qk, qk, v, v, heads, heads]


def unshard(pmap: ParamMap, shards: list[Tensor], arch: TextArch) -> list[Tensor]:
    """The HF tensors of ``pmap`` from its ``tp_size`` Megatron parts (inverse of :func:`shard`).

    For an expert this is that expert's slice; :class:`ExpertStacker` rebuilds the HF tensor.
    """
    kind = pmap.kind.removeprefix("expert_")
    if kind == "replicated":
        return [shards[0]]
    if kind == "row":
        return [torch.cat(shards, dim=0)]
    if kind == "col":
        return [torch.cat(shards, dim=1)]
    if kind == "gate_up":
        halves = [s.chunk(2) for s in shards]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        return [torch.cat([gate, up])] if pmap.kind.startswith("expert_") else [gate, up]
    if kind == "qkv":
        return list(split_qkv(torch.cat(shards), arch))
    if kind in ("gdn_in", "gdn_conv"):
        sizes = _gdn_sections(arch, kind)
        local = [n // len(shards) for n in sizes]
        per_rank = [s.split(local) for s in shards]
        full = [torch.cat([r[i] for r in per_rank]) for i in range(len(sizes))]
        if kind == "gdn_conv":
            return [torch.cat(full)]
        return [torch.cat(full[:3]), *full[3:]]  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    raise ValueError(f"unknown kind {kind!r}")


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: TextArch) -> Tensor:
    """Megatron's fused QKV: per query group, that group's query heads then its key and value.

    With ``arch.attention_output_gate`` (Qwen3.5) HF's ``q_proj`` holds ``[q_h; gate_h]`` per
    head and each group is ``[its query heads, their gates, key, value]``, megatron-core's
    layout for ``attention_output_gate``.
    """
    groups, hd = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    if arch.attention_output_gate:
        heads = q.reshape(groups, per_group, 2, hd, *tail)
        queries = [heads[:, :, 0].reshape(groups, per_group * hd, *tail)]
        queries.append(heads[:, :, 1].reshape(groups, per_group * hd, *tail))
    else:
        queries = [q.reshape(groups, per_group * hd, *tail)]
    fused = torch.cat([*queries, k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)], dim=1)
    return fused.reshape(-1, *tail)


def split_qkv(fused: Tensor, arch: TextArch) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    tail = fused.shape[1:]
    n_q = 2 * per_group if arch.attention_output_gate else per_group
    grouped = fused.reshape(groups, (n_q + 2) * hd, *tail)
    q, k, v = grouped.split([n_q * hd, hd, hd], dim=1)
    if arch.attention_output_gate:  # back to HF's per-head [q_h; gate_h]
        q = q.reshape(groups, 2, per_group, hd, *tail).transpose(1, 2)
    return (
        q.reshape(groups * n_q * hd, *tail).contiguous(),
        k.reshape(groups * hd, *tail).contiguous(),
        v.reshape(groups * hd, *tail).contiguous(),
    )


class ExpertStacker:
    """Collects expert slices (any order) and hands back each stacked HF tensor once complete."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, Tensor]] = {}

    def add(self, pmap: ParamMap, hf_name: str, expert: int, tensor: Tensor) -> Tensor | None:
        parts = self._parts.setdefault(hf_name, {})
        parts[expert] = tensor
        if len(parts) < pmap.num_experts:
            return None
        del self._parts[hf_name]
        return torch.stack([parts[e] for e in range(pmap.num_experts)])


def hf_to_megatron_stage(
    get_hf: Callable[[str], Tensor],
    arch: TextArch,
    stage: StageLayout,
    tp_rank: int,
    tp_size: int,
    *,
    vision_names: Iterable[str] = (),
    use_te: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(megatron_name, tensor)`` for one (TP rank, PP stage) from HF tensors.

    ``get_hf(name)`` loads one HF tensor (e.g. lazily from safetensors), so at most one
    parameter's HF tensors are in memory beside what the caller keeps.
    """
    for pmap in stage_param_maps(arch, stage, vision_names=vision_names, use_te=use_te):
        yield pmap.megatron, shard(pmap, [get_hf(n) for n in pmap.hf], arch, tp_rank, tp_size)


def megatron_to_hf_stage(
    get_shards: Callable[[str], list[Tensor]],
    arch: TextArch,
    stage: StageLayout,
    *,
    vision_names: Iterable[str] = (),
    use_te: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, tensor)`` for one PP stage from its TP shards.

    ``get_shards(megatron_name)`` returns that parameter's tensors of every TP rank, in rank
    order. The tied last-stage copy of the embedding is skipped (the first stage gives it).
    """
    stacker = ExpertStacker()
    for pmap in stage_param_maps(arch, stage, vision_names=vision_names, use_te=use_te):
        if pmap.megatron == "language_model.output_layer.weight" and arch.tie_word_embeddings:
            continue
        tensors = unshard(pmap, get_shards(pmap.megatron), arch)
        if pmap.expert is not None:
            stacked = stacker.add(pmap, pmap.hf[0], pmap.expert, tensors[0])
            if stacked is not None:
                yield pmap.hf[0], stacked
            continue
        yield from zip(pmap.hf, tensors, strict=True)


def hf_state_dict_to_megatron(
    hf_state: Mapping[str, Tensor],
    arch: TextArch,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    use_te: bool = False,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> dict[tuple[int, int], dict[str, Tensor]]:
    """All shards ``{(tp_rank, pp_rank): state_dict}`` of an in-memory HF state dict."""
    stages = stage_layouts(
        arch.num_layers,
        pp_size,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    vision = vision_names_from(hf_state)
    return {
        (tp, stage.pp_rank): dict(
            hf_to_megatron_stage(
                hf_state.__getitem__, arch, stage, tp, tp_size, vision_names=vision, use_te=use_te
            )
        )
        for stage in stages
        for tp in range(tp_size)
    }


def megatron_shards_to_hf(
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]],
    arch: TextArch,
    *,
    use_te: bool = False,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> dict[str, Tensor]:
    """Inverse of :func:`hf_state_dict_to_megatron`."""
    tp_size = 1 + max(tp for tp, _ in shards)
    pp_size = 1 + max(pp for _, pp in shards)
    stages = stage_layouts(
        arch.num_layers,
        pp_size,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    vision = [n[len("visual.") :] for n in shards[(0, 0)] if n.startswith("visual.")]
    out: dict[str, Tensor] = {}
    for stage in stages:

        def get_shards(name: str, pp: int = stage.pp_rank) -> list[Tensor]:
            return [shards[(tp, pp)][name] for tp in range(tp_size)]

        out.update(
            megatron_to_hf_stage(get_shards, arch, stage, vision_names=vision, use_te=use_te)
        )
    return out
