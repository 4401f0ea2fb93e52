"""HF <-> Megatron weight layout for Qwen3-VL: names, fusion, tensor and pipeline splits.

Everything here is pure tensor bookkeeping (no process groups), so it serves the offline
converters in ``tools/`` and the live export alike. One :class:`ParamMap` ties a Megatron
parameter of one pipeline stage to the HF tensors it is made of and says how it is split over
tensor-parallel ranks:

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

MoE experts are also split over expert-parallel ranks: rank ``r`` holds global experts
``r * E / ep ... (r + 1) * E / ep - 1`` as ``local_experts.0 ...``. HF names and shapes are
those of the in-memory transformers model (its ``state_dict()``); released Qwen3-VL-MoE files
store the stacked experts transposed (``[E, H, 2I]``, ``[E, I, H]``), which
:func:`from_file_layout` / :func:`to_file_layout` convert.

Megatron names are relative to :class:`~vlm_models.megatron.model.Qwen3VLMegatronModel`
(``language_model.decoder.layers.{local}.…``, ``visual.…``); HF names are those of
``Qwen3VLForConditionalGeneration.state_dict()`` (``model.language_model.layers.{i}.…``,
``model.visual.…``, ``lm_head.weight``). The round trip is exact: only views, splits and
concatenations, never arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from vlm_models.megatron.config import TextArch

HF_TEXT = "model.language_model."
HF_VISUAL = "model.visual."
MG_DECODER = "language_model.decoder."

KINDS = (
    "replicated",
    "row",
    "col",
    "qkv",
    "gate_up",
    "gdn_in",
    "gdn_conv",
    "expert_gate_up",
    "expert_col",
)


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of (``expert``: global index)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: int | None = None
    num_experts: int | None = None


@dataclass(frozen=True)
class StageLayout:
    """Which global decoder layers a pipeline stage holds, and whether it is first/last."""

    pp_rank: int
    pp_size: int
    layer_offset: int
    num_layers: int

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def stage_layouts(
    num_layers: int,
    pp_size: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[StageLayout]:
    """Layer split over ``pp_size`` stages, the way Megatron splits (even, or first/last fixed)."""
    middle = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    rest = num_layers - (first_stage_layers or 0) - (last_stage_layers or 0)
    if middle < 0 or rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise ValueError(
            f"cannot split {num_layers} layers over {pp_size} stages "
            f"(first={first_stage_layers}, last={last_stage_layers})"
        )
    per_middle = rest // middle if middle else 0
    counts = [per_middle] * pp_size
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    layouts, offset = [], 0
    for rank, count in enumerate(counts):
        layouts.append(StageLayout(rank, pp_size, offset, count))
        offset += count
    return layouts


def _layer_maps(
    arch: TextArch, local: int, layer: int, use_te: bool, ep_rank: int = 0, ep_size: int = 1
) -> list[ParamMap]:
    mg = f"{MG_DECODER}layers.{local}."
    hf = f"{HF_TEXT}layers.{layer}."
    attn_norm = (
        "self_attention.linear_qkv.layer_norm_weight" if use_te else "input_layernorm.weight"
    )
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if use_te else "pre_mlp_layernorm.weight"
    if arch.num_experts and use_te:
        mlp_norm = "pre_mlp_layernorm.weight"  # TE's MoE spec keeps a separate norm
    linear = arch.is_linear(layer)  # Qwen3.5's gated delta net, else (gated) attention
    maps = _gdn_maps(mg, hf) if linear else _attention_maps(arch, mg, hf, attn_norm)
    maps.append(ParamMap(mg + mlp_norm, (hf + "post_attention_layernorm.weight",), "replicated"))
    return maps + _mlp_maps(arch, mg, hf, use_te, ep_rank, ep_size)


def _gdn_maps(layer_mg: str, hf: str) -> list[ParamMap]:
    """Qwen3.5's gated-delta-net token mixer (megatron-core's ``GatedDeltaNet`` names)."""
    mg, la = layer_mg + "self_attention.", hf + "linear_attn."
    return [
        ParamMap(
            layer_mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"
        ),
        ParamMap(
            mg + "in_proj.weight",
            tuple(la + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
            "gdn_in",
        ),
        ParamMap(mg + "conv1d.weight", (la + "conv1d.weight",), "gdn_conv"),
        ParamMap(mg + "A_log", (la + "A_log",), "row"),
        ParamMap(mg + "dt_bias", (la + "dt_bias",), "row"),
        ParamMap(mg + "out_norm.weight", (la + "norm.weight",), "replicated"),
        ParamMap(mg + "out_proj.weight", (la + "out_proj.weight",), "col"),
    ]


def _attention_maps(arch: TextArch, mg: str, hf: str, attn_norm: str) -> list[ParamMap]:
    maps = [
        ParamMap(mg + attn_norm, (hf + "input_layernorm.weight",), "replicated"),
        ParamMap(
            mg + "self_attention.linear_qkv.weight",
            tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
        ),
        ParamMap(
            mg + "self_attention.q_layernorm.weight",
            (hf + "self_attn.q_norm.weight",),
            "replicated",
        ),
        ParamMap(
            mg + "self_attention.k_layernorm.weight",
            (hf + "self_attn.k_norm.weight",),
            "replicated",
        ),
        ParamMap(
            mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "col"
        ),
    ]
    if arch.attention_bias:
        maps.append(
            ParamMap(
                mg + "self_attention.linear_qkv.bias",
                tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                "qkv",
            )
        )
    return maps


def _mlp_maps(
    arch: TextArch, mg: str, hf: str, use_te: bool, ep_rank: int, ep_size: int
) -> list[ParamMap]:
    maps: list[ParamMap] = []
    if arch.num_experts:
        if use_te:
            raise NotImplementedError("Transformer Engine names for MoE experts are not mapped")
        if arch.num_experts % ep_size:
            raise ValueError(f"{arch.num_experts} experts do not split over ep={ep_size}")
        maps.append(ParamMap(mg + "mlp.router.weight", (hf + "mlp.gate.weight",), "replicated"))
        if arch.shared_expert_intermediate_size:  # Qwen3.5: a gated shared expert
            shared = hf + "mlp.shared_expert."
            maps += [
                ParamMap(
                    mg + "mlp.shared_experts.linear_fc1.weight",
                    (shared + "gate_proj.weight", shared + "up_proj.weight"),
                    "gate_up",
                ),
                ParamMap(
                    mg + "mlp.shared_experts.linear_fc2.weight",
                    (shared + "down_proj.weight",),
                    "col",
                ),
                ParamMap(
                    mg + "mlp.shared_experts.gate_weight",
                    (hf + "mlp.shared_expert_gate.weight",),
                    "replicated",
                ),
            ]
        # HF stacks all experts in two tensors; Megatron has one module per local expert.
        n_local = arch.num_experts // ep_size
        for e in range(n_local):
            expert = ep_rank * n_local + e
            mg_e = f"{mg}mlp.experts.local_experts.{e}."
            maps += [
                ParamMap(
                    mg_e + "linear_fc1.weight",
                    (hf + "mlp.experts.gate_up_proj",),
                    "expert_gate_up",
                    expert,
                    arch.num_experts,
                ),
                ParamMap(
                    mg_e + "linear_fc2.weight",
                    (hf + "mlp.experts.down_proj",),
                    "expert_col",
                    expert,
                    arch.num_experts,
                ),
            ]
    else:
        maps += [
            ParamMap(
                mg + "mlp.linear_fc1.weight",
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                "gate_up",
            ),
            ParamMap(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "col"),
        ]
    return maps


def stage_param_maps(
    arch: TextArch,
    stage: StageLayout,
    *,
    vision_names: Iterable[str] = (),
    use_te: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[ParamMap]:
    """Every parameter of one pipeline stage (of one expert-parallel rank), in a stable order.

    ``vision_names`` are the HF vision tower's parameter names without ``model.visual.``
    (``model.visual`` state-dict keys); they go to the first stage unchanged.
    """
    maps: list[ParamMap] = []
    if stage.first:
        maps += [ParamMap("visual." + n, (HF_VISUAL + n,), "replicated") for n in vision_names]
        maps.append(
            ParamMap(
                "language_model.embedding.word_embeddings.weight",
                (HF_TEXT + "embed_tokens.weight",),
                "row",
            )
        )
    for local in range(stage.num_layers):
        maps += _layer_maps(arch, local, stage.layer_offset + local, use_te, ep_rank, ep_size)
    if stage.last:
        maps.append(
            ParamMap(
                "language_model.decoder.final_layernorm.weight",
                (HF_TEXT + "norm.weight",),
                "replicated",
            )
        )
        if not arch.tie_word_embeddings:
            maps.append(ParamMap("language_model.output_layer.weight", ("lm_head.weight",), "row"))
        elif not stage.first:
            # Tied and pipelined: the last stage holds its own copy of the embedding.
            maps.append(
                ParamMap(
                    "language_model.output_layer.weight", (HF_TEXT + "embed_tokens.weight",), "row"
                )
            )
    return maps


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


_EXPERT_STACKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _memory_shape(name: str, arch: TextArch) -> tuple[int, int, int]:
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
    return (e, 2 * i, h) if name.endswith("gate_up_proj") else (e, h, i)


def is_released_expert_layout(name: str, shape: tuple[int, ...], arch: TextArch) -> bool:
    """Whether a file's stacked-expert tensor is in the released (transposed) layout.

    Released Qwen3-VL-MoE files hold ``[E, H, 2I]`` / ``[E, I, H]``; transformers keeps
    ``[E, 2I, H]`` / ``[E, H, I]`` in memory and 5.x ``save_pretrained`` writes that. Like
    transformers, a shape equal to the in-memory one counts as in-memory (square experts are
    ambiguous).
    """
    return name.endswith(_EXPERT_STACKS) and tuple(shape) != _memory_shape(name, arch)


def from_file_layout(name: str, tensor: Tensor, arch: TextArch) -> Tensor:
    """A checkpoint-file tensor in transformers' in-memory layout."""
    if is_released_expert_layout(name, tuple(tensor.shape), arch):
        return tensor.transpose(1, 2).contiguous()
    return tensor


def to_file_layout(name: str, tensor: Tensor, *, released: bool = True) -> Tensor:
    """An in-memory tensor in the released files' layout (``released=False``: unchanged)."""
    if released and name.endswith(_EXPERT_STACKS):
        return tensor.transpose(1, 2).contiguous()
    return tensor


def to_checkpoint_tensors(name: str, tensor: Tensor, arch: TextArch) -> list[tuple[str, Tensor]]:
    """An in-memory tensor as ``save_pretrained`` writes it and SGLang reads it (the wire layout
    of weight sync): Qwen3.5-MoE experts one per tensor, Qwen3-VL-MoE's transposed."""
    if not name.endswith(_EXPERT_STACKS):
        return [(name, tensor)]
    if arch.per_expert_files:
        return split_experts(name, tensor)
    return [(name, to_file_layout(name, tensor))]


def per_expert_names(name: str, num_experts: int) -> list[tuple[str, ...]]:
    """The per-expert file names of stacked tensor ``name`` (Qwen3.5-MoE files, which
    transformers stacks on load: ``experts.{e}.gate_proj`` / ``up_proj`` -> ``gate_up_proj``,
    ``experts.{e}.down_proj`` -> ``down_proj``)."""
    base = name.rsplit(".", 1)[0]  # "...mlp.experts"
    if name.endswith("gate_up_proj"):
        return [
            (f"{base}.{e}.gate_proj.weight", f"{base}.{e}.up_proj.weight")
            for e in range(num_experts)
        ]
    return [(f"{base}.{e}.down_proj.weight",) for e in range(num_experts)]


def stack_experts(parts: list[list[Tensor]]) -> Tensor:
    """The stacked in-memory tensor from each expert's file tensors (gate and up, or down)."""
    return torch.stack([torch.cat(p) if len(p) > 1 else p[0] for p in parts])


def split_experts(name: str, stacked: Tensor) -> list[tuple[str, Tensor]]:
    """Inverse of :func:`stack_experts`, under :func:`per_expert_names`."""
    out = []
    for names, expert in zip(per_expert_names(name, stacked.shape[0]), stacked, strict=True):
        out += zip(names, expert.chunk(len(names)), strict=True)
    return [(n, t.contiguous()) for n, t in out]


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


def vision_names_from(hf_names: Iterable[str]) -> list[str]:
    """The vision tower's parameter names (``model.visual.`` stripped) among ``hf_names``."""
    return [n[len(HF_VISUAL) :] for n in hf_names if n.startswith(HF_VISUAL)]


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
