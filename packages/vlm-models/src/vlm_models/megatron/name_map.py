"""Which Megatron parameter is made of which HF tensors, for Qwen3-VL and Qwen3.5: the name
map of one pipeline stage (one expert-parallel rank) as :class:`ParamMap` rows, each with the
kind of tensor-parallel split that :func:`vlm_models.megatron.convert.shard` makes (the table
of kinds is in that module). Names only: no tensor is touched here, so the converters, the live
export and the checkpoint reader share one map.

Megatron names are relative to :class:`~vlm_models.megatron.model.Qwen3VLMegatronModel`
(``language_model.decoder.layers.{local}.…``, ``visual.…``); HF names are those of
``Qwen3VLForConditionalGeneration.state_dict()`` (``model.language_model.layers.{i}.…``,
``model.visual.…``, ``lm_head.weight``). Pipeline stages follow Megatron's split of the
decoder layers (:func:`stage_layouts`). MoE experts are also split over expert-parallel ranks:
rank ``r`` holds global experts ``r * E / ep ... (r + 1) * E / ep - 1`` as
``local_experts.0 ...``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


def vision_names_from(hf_names: Iterable[str]) -> list[str]:
    """The vision tower's parameter names (``model.visual.`` stripped) among ``hf_names``."""
    return [n[len(HF_VISUAL) :] for n in hf_names if n.startswith(HF_VISUAL)]
