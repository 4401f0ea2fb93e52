"""Load HF weights into a live Megatron model, and stream its weights back out with HF names.

:func:`iter_hf_weights` is what rollout weight sync uses: every rank of the model-parallel
group takes part (TP all-gathers, PP broadcasts) and every rank receives the whole model as
buckets of ``(hf_name, full_tensor)``, the same names and shapes as
``Qwen3VLForConditionalGeneration.state_dict()``, in a stable order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor

from vlm_models.megatron.convert import ExpertStacker, shard, unshard
from vlm_models.megatron.file_layout import to_checkpoint_tensors
from vlm_models.megatron.model import Qwen3VLMegatronModel
from vlm_models.megatron.name_map import ParamMap, StageLayout, stage_param_maps
from weight_sync import iter_weight_buckets

logger = logging.getLogger(__name__)


def stage_layout(model: Qwen3VLMegatronModel) -> StageLayout:
    """The pipeline stage this rank's ``model`` holds."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return StageLayout(
        pp_rank=pp_rank,
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        layer_offset=get_transformer_layer_offset(model.config, pp_rank=pp_rank),
        num_layers=len(model.language_model.decoder.layers),
    )


def param_maps(model: Qwen3VLMegatronModel) -> list[ParamMap]:
    """The HF <-> Megatron map of every tensor in this rank's ``model``."""
    vision = list(model.visual.state_dict()) if model.visual is not None else []
    return stage_param_maps(
        model.arch,
        stage_layout(model),
        vision_names=vision,
        use_te=model.use_te,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
    )


def _tp_rank_size(pmap: ParamMap) -> tuple[int, int]:
    """Experts split over the expert-TP group, everything else over the TP group."""
    if pmap.expert is not None:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _model_tensors(model: Qwen3VLMegatronModel) -> dict[str, Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


@torch.no_grad()
def load_hf_weights(
    model: Qwen3VLMegatronModel, hf: Mapping[str, Tensor] | Callable[[str], Tensor]
) -> None:
    """Copy HF-named weights (a state dict, or a loader ``name -> tensor``) into ``model``.

    Each rank takes its own TP part of its own PP stage. Every model tensor must be covered.
    """
    get_hf = hf.__getitem__ if isinstance(hf, Mapping) else hf
    tensors = _model_tensors(model)
    maps = param_maps(model)
    missing = set(tensors) - {m.megatron for m in maps}
    if missing:
        raise KeyError(f"no HF source for Megatron tensors: {sorted(missing)[:8]}")
    for pmap in maps:
        value = shard(pmap, [get_hf(n) for n in pmap.hf], model.arch, *_tp_rank_size(pmap))
        target = tensors[pmap.megatron]
        if target.shape != value.shape:
            raise ValueError(
                f"{pmap.megatron}: model shape {tuple(target.shape)} but {pmap.hf} give "
                f"{tuple(value.shape)}"
            )
        target.copy_(value)
    logger.info("loaded %d HF tensors into stage %d", len(maps), stage_layout(model).pp_rank)


def _gather_tp(local: Tensor, group: dist.ProcessGroup, size: int) -> list[Tensor]:
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts


@torch.no_grad()
def iter_hf_weights(
    model: Qwen3VLMegatronModel, bucket_bytes: int = 512 << 20, *, file_layout: bool = False
) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` of the whole model, on every rank.

    Must be called on all ranks of the TP x PP group together. Buckets are made by
    :func:`weight_sync.iter_weight_buckets` (at most ``bucket_bytes``; a single larger tensor
    makes a bucket of its own), as for the FSDP trainer. Tensors are
    in transformers' in-memory layout, or with ``file_layout`` in the model type's checkpoint
    layout (:func:`~vlm_models.megatron.file_layout.to_checkpoint_tensors`: Qwen3-VL-MoE experts
    transposed, Qwen3.5-MoE experts one tensor each), the wire layout of weight sync, which is
    what engines loading the checkpoint files expect.
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    etp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else []
    tensors = _model_tensors(model)
    maps = param_maps(model)
    device = next(iter(tensors.values())).device

    def full_tensors(pmap: ParamMap, stacker: ExpertStacker) -> list[tuple[str, Tensor]]:
        """This map's HF tensors once complete (an expert: when its last slice arrives)."""
        local = tensors[pmap.megatron]
        if pmap.kind == "replicated":
            return [(pmap.hf[0], local)]
        if pmap.expert is None:
            parts = _gather_tp(local, tp_group, tp_size)
            return list(zip(pmap.hf, unshard(pmap, parts, model.arch), strict=True))
        parts = [local] if etp_size == 1 else _gather_tp(local, etp_group, etp_size)
        (expert_tensor,) = unshard(pmap, parts, model.arch)
        # The same local expert of every EP rank: global experts r * n_local + local.
        n_local = pmap.num_experts // ep_size
        local_index = pmap.expert % n_local
        gathered = [expert_tensor] if ep_size == 1 else _gather_tp(expert_tensor, ep_group, ep_size)
        out = []
        for r, t in enumerate(gathered):
            stacked = stacker.add(pmap, pmap.hf[0], r * n_local + local_index, t)
            if stacked is not None:
                out.append((pmap.hf[0], stacked))
        return out

    def local_tensors() -> Iterator[tuple[str, Tensor]]:
        stacker = ExpertStacker()
        for pmap in maps:
            if (
                pmap.megatron == "language_model.output_layer.weight"
                and model.arch.tie_word_embeddings
            ):
                continue  # tied: the first stage's embedding is the HF tensor
            for name, full in full_tensors(pmap, stacker):
                if file_layout:
                    yield from to_checkpoint_tensors(name, full, model.arch)
                else:
                    yield name, full

    def local_buckets() -> Iterator[list[tuple[str, Tensor]]]:
        # the one bucketer of weight sync, shared with the FSDP trainer
        yield from iter_weight_buckets(local_tensors(), bucket_bytes)

    if pp_size == 1:
        yield from local_buckets()
        return
    for stage in range(pp_size):
        source = local_buckets() if stage == pp_rank else None
        while True:
            # The owning stage announces each bucket's layout, then broadcasts its tensors.
            bucket = next(source, None) if source is not None else None
            meta = [None if bucket is None else [(n, t.shape, t.dtype) for n, t in bucket]]
            dist.broadcast_object_list(meta, src=pp_ranks[stage], group=pp_group)
            if meta[0] is None:
                break
            if bucket is None:
                bucket = [(n, torch.empty(s, dtype=d, device=device)) for n, s, d in meta[0]]
            for _, tensor in bucket:
                dist.broadcast(tensor, src=pp_ranks[stage], group=pp_group)
            yield bucket
