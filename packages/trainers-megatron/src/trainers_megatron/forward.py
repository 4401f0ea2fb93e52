"""How one pipeline stage of the Megatron actor runs a packed micro-batch: the decoder call
(whole THD row, or this rank's zigzag part under context parallelism), the routers set to the
engine's expert ids under routing replay, and on the last stage the aligned log-probs, from
vocabulary-parallel logits that are never gathered.

Apart from the actor because it is what megatron-core's schedule calls for each micro-batch
(:func:`trainers_megatron.schedule.run_schedule`), in ``compute_logprobs`` and in the train
step alike, and it reads only the stage's place in the layout (:class:`StageActor`); the actor
imports this module, never the other way.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor
from torch.profiler import record_function

from rl_algos import aligned_logprobs, logprobs_from_logits, scatter_rows
from trainer_core import MicroBatch
from trainers_megatron.config import MegatronConfig
from trainers_megatron.context_parallel import RowSplit
from vlm_models.megatron.context_parallel import reduce_over_cp
from vlm_models.megatron.routing_replay import (
    clear_routes,
    local_routes,
    replay_routers,
    set_routes,
)


class StageActor(Protocol):
    """What a stage's forward reads of a `trainers_megatron.actor.MegatronActor`."""

    config: MegatronConfig
    first_stage: bool  # the pipeline's first stage: it embeds and runs the vision tower
    last_stage: bool  # the pipeline's last stage: it scores
    tp_size: int  # the vocabulary is split over the tensor-parallel ranks
    cp_group: Any  # the context-parallel group the zigzag parts are summed over
    compiled: bool


def _vocab_parallel_aligned_logprobs(
    logits: Tensor, input_ids: Tensor, cu_seqlens: Tensor, temperature: float
) -> Tensor:
    """``rl_algos.aligned_logprobs`` for vocabulary-sharded logits ``[T, V / tp]``.

    Megatron's vocab-parallel cross entropy reduces over the TP group, so the full-vocabulary
    logits are never gathered (float32 on this rank's slice only).
    """
    next_ids = torch.roll(input_ids, -1)
    scaled = logits.float() / temperature
    lp = -tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None], next_ids[:, None])[:, 0]
    shifted = torch.cat([lp.new_zeros(1), lp[:-1]])
    first = torch.zeros_like(shifted, dtype=torch.bool)
    first[cu_seqlens[:-1].long()] = True
    return shifted.masked_fill(first, 0.0)


def stage_forward(actor: StageActor, mb: MicroBatch, model: torch.nn.Module) -> Tensor:
    """This stage's output for a packed micro-batch: hidden states for the next stage, or
    on the last stage the aligned log-probs ``[T_real]`` (float32).

    Only the rows that predict loss tokens go through the output layer; other positions
    hold 0, which the token alignment convention allows (as in the FSDP actor).
    """
    if actor.config.routing_replay:
        _route(actor, mb, model)
    if mb.context_parallel is not None:
        return _stage_forward_cp(actor, mb, model, mb.context_parallel)
    longest = mb.max_seqlen
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    positions = mb.loss_positions
    if positions is not None and positions.numel() == 0:
        positions = None  # nothing to score: the plain path keeps the graph whole
    rows = None if positions is None or not actor.last_stage else positions - 1
    with record_function("megatron_actor.forward"):
        out = model(
            mb.input_ids[None],
            mb.position_ids[1:, None, :],  # the M-RoPE rows (t, h, w)
            pixel_values=mb.pixel_values if actor.first_stage else None,
            image_grid_thw=mb.image_grid_thw if actor.first_stage else None,
            packed_seq_params=packed,
            image_positions=mb.image_positions,
            vision_inputs=mb.vision_inputs,
            logit_rows=rows,
        )
    if not actor.last_stage:
        return out  # [T(/tp), 1, H]: the next stage's input
    logits = out[0]  # [T or R, V / tp]: this rank's slice of the vocabulary
    temperature = actor.config.temperature
    if positions is None:
        if actor.tp_size == 1:
            lp = aligned_logprobs(
                logits, mb.input_ids, mb.cu_seqlens, temperature, compiled=actor.compiled
            )
        else:
            lp = _vocab_parallel_aligned_logprobs(logits, mb.input_ids, mb.cu_seqlens, temperature)
        return lp[: mb.num_real_tokens]
    scored = _score(actor, logits, mb.input_ids[positions])
    return scatter_rows(scored, positions, mb.input_ids.shape[0])[: mb.num_real_tokens]


def _route(actor: StageActor, mb: MicroBatch, model: torch.nn.Module) -> None:
    """This stage's routers to ``mb``'s expert ids on this rank's tokens (zigzag part,
    sequence-parallel slice), or to their own top-k for a micro-batch without them. The
    ids stay until the next micro-batch's forward: one stage runs this micro-batch's
    backward, with its recompute, in between."""
    routers = replay_routers(model)
    if mb.routed_experts is None:
        clear_routes(routers)
        return
    split = mb.context_parallel
    ids = local_routes(
        mb.routed_experts,
        zigzag=None if split is None else split.layout,
        sequence_parallel=actor.config.sp,
    )
    set_routes(routers, ids)


def clear_replayed_routes(actor: StageActor, model: torch.nn.Module) -> None:
    """Under routing replay, ``model``'s routers back to their own top-k once a pass is done."""
    if actor.config.routing_replay:
        clear_routes(replay_routers(model))


def drop_dispatch_state(model: torch.nn.Module) -> None:
    """Drop the per-token tensors ``model``'s MoE token dispatchers keep from their last
    forward (megatron-core 0.16.1 leaves them as attributes until the next one: the router's
    probabilities and routing map, ``[tokens, experts]`` each, the permutation's indices and
    the split sizes, which its ``cudagraph_attrs`` name); each forward sets them again before
    reading them."""
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None:
            continue
        names = [*getattr(dispatcher, "cudagraph_attrs", ()), "probs", "local_map", "local_probs"]
        for name in names:
            if isinstance(getattr(dispatcher, name, None), Tensor):
                setattr(dispatcher, name, None)


def _score(actor: StageActor, logits: Tensor, targets: Tensor) -> Tensor:
    """Log-probs of ``targets`` under ``logits`` ``[R, V / tp]`` (float32)."""
    temperature = actor.config.temperature
    if actor.tp_size == 1:
        return logprobs_from_logits(logits, targets, temperature, compiled=actor.compiled)
    # vocabulary-parallel: the full-vocabulary logits are never gathered
    scaled = logits.float() / temperature
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None], targets[:, None])[:, 0]


def _stage_forward_cp(
    actor: StageActor, mb: MicroBatch, model: torch.nn.Module, split: RowSplit
) -> Tensor:
    """:func:`stage_forward` of a zigzag-split row: this rank's part through the decoder;
    on the last stage the log-probs of the scored tokens whose predecessor row is here,
    summed over CP ranks into the whole row's (the same on every CP rank)."""
    with record_function("megatron_actor.forward"):
        out = model(
            mb.input_ids[None],
            mb.position_ids[1:, None, :],
            pixel_values=mb.pixel_values if actor.first_stage else None,
            image_grid_thw=mb.image_grid_thw if actor.first_stage else None,
            packed_seq_params=split.params,
            image_positions=mb.image_positions,
            vision_inputs=mb.vision_inputs,
            logit_rows=split.local_rows if actor.last_stage else None,
        )
    if not actor.last_stage:
        return out  # [T_local(/tp), 1, H]
    scored = _score(actor, out[0], mb.input_ids[split.positions])
    whole = scatter_rows(scored, split.positions, mb.input_ids.shape[0])
    return reduce_over_cp(whole, actor.cp_group)[: mb.num_real_tokens]
