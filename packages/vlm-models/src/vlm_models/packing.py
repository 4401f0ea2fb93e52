"""Packed (padding-free) inputs for Qwen3-VL: M-RoPE position ids and forward arguments.

Trainers concatenate samples end to end into one row of ``T`` tokens. Two things must then
match what the model would see for each sample alone:

1. **Rotary positions.** Each sample's 3-D M-RoPE ids (temporal, height, width) are computed
   by the model's own ``get_rope_index`` on that sample alone, then concatenated.
2. **Attention boundaries.** The HF text model accepts ``position_ids`` of shape ``[4, 1, T]``:
   row 0 is the plain text position (``0..L_i-1`` restarting per sample) and rows 1-3 the M-RoPE
   ids. With ``attention_mask=None`` transformers reads sample boundaries from row 0: sdpa and
   eager get a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``) and
   flash-attention runs varlen over the same boundaries. The vision tower already attends per
   image (its ``cu_seqlens`` come from ``image_grid_thw``), so images need nothing extra.

So a packed forward is ``model(**packed_inputs(...))`` (the dict carries ``use_cache=False``:
with a cache transformers skips the boundary detection) with no attention mask; its logits
equal the per-sample logits (tested on CPU with sdpa and eager, dense and MoE).

Qwen3.5 is different: its gated-delta-net (linear attention) layers carry a recurrent state
(and a short causal convolution) along the row, and transformers' forward does not reset them at
sample boundaries (packed != per-sample). ``build_model(packed_linear_attention=True)`` runs
those layers with a forward that does, given the boundaries as the ``packed_seq_info`` keyword
(the FSDP actor passes them); :func:`packed_inputs` does not, so it refuses such models.
:func:`supports_packed_forward` says which models (or configs) pack; run the others one sample
per row.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from vlm_models.linear_attention import has_linear_attention, linear_attention_packs

logger = logging.getLogger(__name__)


def _model_class(config: PretrainedConfig) -> type:
    """The ``*Model`` class whose ``get_rope_index`` belongs to ``config``'s architecture."""
    model_type = config.model_type
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as cls
    elif model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel as cls
    elif model_type == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model as cls
    elif model_type == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel as cls
    else:
        raise ValueError(f"packed M-RoPE ids: unsupported model_type {model_type!r}")
    return cls


@functools.lru_cache(maxsize=8)
def _rope_index_fn(cls: type) -> tuple[Any, bool]:
    fn = cls.get_rope_index
    return fn, "mm_token_type_ids" in inspect.signature(fn).parameters


@functools.lru_cache(maxsize=8)
def _rope_stand_in(cls: type) -> type:
    """A weightless class holding ``cls``' helpers that ``get_rope_index`` calls on ``self``
    (taken as they are declared, so a staticmethod stays one)."""
    names = ("get_vision_position_ids", "get_llm_pos_ids_for_vision")
    attrs = {n: inspect.getattr_static(cls, n) for n in names if hasattr(cls, n)}
    return type(f"{cls.__name__}RopeIndex", (), attrs)


def _rope_owner(config_or_model: PretrainedConfig | nn.Module) -> tuple[Any, type]:
    """An object to call ``get_rope_index`` on: the model's inner ``*Model``, or - from a config
    alone - a stand-in holding just ``config`` and the helpers ``get_rope_index`` uses, so no
    weights are allocated to compute positions."""
    if isinstance(config_or_model, nn.Module):
        inner = getattr(config_or_model, "model", config_or_model)
        return inner, type(inner)
    config = config_or_model
    cls = _model_class(config)
    owner = _rope_stand_in(cls)()
    owner.config, owner.rope_deltas = config, None
    return owner, cls


def mm_token_types(input_ids: Tensor, config: PretrainedConfig) -> Tensor:
    """The processor's ``mm_token_type_ids``: 1 at image tokens, 2 at video tokens, else 0."""
    types_ = torch.zeros_like(input_ids, dtype=torch.int32)
    types_[input_ids == config.image_token_id] = 1
    types_[input_ids == config.video_token_id] = 2
    return types_


def sample_position_ids(
    input_ids: Tensor,
    image_grid_thw: Tensor | None,
    config_or_model: PretrainedConfig | nn.Module,
    mm_token_type_ids: Tensor | None = None,
    *,
    memo: dict | None = None,
) -> Tensor:
    """M-RoPE ids ``[3, L]`` of one unpadded sample, computed by the model's ``get_rope_index``.

    ``memo`` (a dict shared over calls) reuses the ids of a sample's head, everything up to the
    first text token after its last image, for later samples with the same token types and
    images there: the ids of the text after the last image only count on from that token (the
    rule of every Qwen-VL ``get_rope_index``; tested against the whole-sample computation). In
    GRPO the samples of a group share the prompt and its image and differ in the response, so
    one packed row computes each prompt's head once.
    """
    owner, cls = _rope_owner(config_or_model)
    config = owner.config
    fn, wants_types = _rope_index_fn(cls)
    ids = input_ids.reshape(1, -1)
    kwargs: dict[str, Any] = {"image_grid_thw": image_grid_thw}
    types_ = mm_token_type_ids if mm_token_type_ids is not None else mm_token_types(ids, config)
    types_ = types_.reshape(1, -1)
    if wants_types:
        kwargs["mm_token_type_ids"] = types_
    n_image_tokens = int((ids == config.image_token_id).sum())
    if image_grid_thw is None or len(image_grid_thw) == 0:
        if n_image_tokens:
            raise ValueError(f"sample has {n_image_tokens} image tokens but no image_grid_thw")
        return torch.arange(ids.shape[1], device=ids.device).expand(3, -1).clone()
    merge = config.vision_config.spatial_merge_size
    expected = int((image_grid_thw.prod(-1) // merge**2).sum())
    if expected != n_image_tokens:
        raise ValueError(
            f"sample has {n_image_tokens} image tokens but image_grid_thw {image_grid_thw.tolist()} "
            f"needs {expected}"
        )
    if memo is None:
        position_ids, _ = fn(owner, ids, **kwargs)
        return position_ids[:, 0]
    # the head: through the first token after the last image (or the whole sample)
    length = ids.shape[1]
    head = min(int((types_[0] != 0).nonzero()[-1]) + 2, length)
    key = (
        types_[0, :head].to(torch.int8).cpu().numpy().tobytes(),
        image_grid_thw.long().cpu().numpy().tobytes(),
    )
    head_ids = memo.get(key)
    if head_ids is None:
        if wants_types:
            kwargs["mm_token_type_ids"] = types_[:, :head]
        position_ids, _ = fn(owner, ids[:, :head], **kwargs)
        head_ids = memo[key] = position_ids[:, 0]
    if head == length:
        return head_ids.clone()  # the memo's tensor stays the caller's to keep
    steps = torch.arange(1, length - head + 1, dtype=head_ids.dtype, device=head_ids.device)
    return torch.cat([head_ids, head_ids[:, -1:] + steps], dim=1)


def packed_position_ids(
    input_ids: Sequence[Tensor],
    image_grid_thw: Sequence[Tensor | None],
    config: PretrainedConfig | nn.Module,
    mm_token_type_ids: Sequence[Tensor | None] | None = None,
) -> Tensor:
    """M-RoPE ids ``[3, T]`` for samples packed end to end (``T = sum(L_i)``).

    Each sample gets exactly the ids the HF model builds for it alone (``get_rope_index`` on
    that sample), so positions restart at 0 for every sample. ``config`` may also be the model.
    """
    if len(input_ids) != len(image_grid_thw):
        raise ValueError(
            f"{len(input_ids)} samples but {len(image_grid_thw)} image_grid_thw entries"
        )
    types_list = mm_token_type_ids or [None] * len(input_ids)
    memo: dict = {}  # one prompt's head once per row (sample_position_ids)
    parts = [
        sample_position_ids(ids, grid, config, types_, memo=memo)
        for ids, grid, types_ in zip(input_ids, image_grid_thw, types_list, strict=True)
    ]
    return torch.cat(parts, dim=1)


def supports_packed_forward(config: PretrainedConfig | nn.Module) -> bool:
    """Whether a packed forward gives per-sample results: a model (or config) without
    linear-attention layers, or a model whose linear-attention layers reset their state at
    sample boundaries (``build_model(packed_linear_attention=True)``; the forward must get
    ``packed_seq_info``)."""
    if not has_linear_attention(config):
        return True
    return isinstance(config, nn.Module) and linear_attention_packs(config)


def text_position_ids(lengths: Sequence[int], device: torch.device | str | None = None) -> Tensor:
    """``[T]`` plain positions restarting at 0 per sample: how transformers finds boundaries."""
    return torch.cat([torch.arange(int(n), device=device) for n in lengths])


def cu_seqlens_from_lengths(
    lengths: Sequence[int], device: torch.device | str | None = None
) -> Tensor:
    """Cumulative lengths ``[n + 1]`` starting at 0 (int32, the flash-attention convention)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), 0)
    return out


def packed_inputs(
    input_ids: Sequence[Tensor],
    *,
    config: PretrainedConfig | nn.Module,
    pixel_values: Sequence[Tensor | None] | None = None,
    image_grid_thw: Sequence[Tensor | None] | None = None,
    mm_token_type_ids: Sequence[Tensor | None] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for a packed forward, ``model(**packed_inputs(...))``.

    Returns ``input_ids [1, T]``, ``position_ids [4, 1, T]`` (text row + M-RoPE rows),
    ``pixel_values`` / ``image_grid_thw`` concatenated over the samples that have images, and
    ``cu_seqlens [n + 1]`` (not a model argument: pop it before the call) and
    ``use_cache=False``. No attention mask, on purpose: transformers then keeps attention within
    samples (see the module docstring). Raises for models with linear-attention layers
    (Qwen3.5): their packed forward needs the boundaries as ``packed_seq_info`` too.
    """
    if has_linear_attention(config):
        raise NotImplementedError(
            "packed_inputs: models with linear-attention layers (Qwen3.5) carry their recurrent "
            "state across sample boundaries unless the forward gets packed_seq_info "
            "(build_model(packed_linear_attention=True)); run one sample per row"
        )
    n = len(input_ids)
    grids = list(image_grid_thw) if image_grid_thw is not None else [None] * n
    pixels = list(pixel_values) if pixel_values is not None else [None] * n
    if len(grids) != n or len(pixels) != n:
        raise ValueError(f"{n} samples, {len(pixels)} pixel_values, {len(grids)} image_grid_thw")
    device = input_ids[0].device
    lengths = [int(ids.numel()) for ids in input_ids]
    mrope = packed_position_ids(input_ids, grids, config, mm_token_type_ids)
    text = text_position_ids(lengths, device=device)
    out: dict[str, Any] = {
        "input_ids": torch.cat([ids.reshape(-1) for ids in input_ids])[None],
        "position_ids": torch.cat([text[None], mrope.to(device)], dim=0)[:, None, :],
        "cu_seqlens": cu_seqlens_from_lengths(lengths, device=device),
        "use_cache": False,
    }
    present = [(p, g) for p, g in zip(pixels, grids, strict=True) if g is not None and len(g)]
    if present:
        if any(p is None for p, _ in present):
            raise ValueError("a sample has image_grid_thw but no pixel_values")
        out["pixel_values"] = torch.cat([p for p, _ in present], dim=0)
        out["image_grid_thw"] = torch.cat([g for _, g in present], dim=0)
    return out
