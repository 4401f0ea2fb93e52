"""Rollout routing replay (R3) on the Megatron model: each router routes to the engine's experts.

megatron-core 0.16.1 builds a ``RouterReplay`` into every ``TopKRouter`` when
``TransformerConfig.moe_enable_routing_replay`` is set; with the ``REPLAY_FORWARD`` action the
router takes its target indices instead of its top-k and weights them by its own scores there
(our config: float32 logits, top-k then softmax over the ``k``, the same as a softmax over all
experts renormalised over the ``k``). Its static helpers walk a process-global list of every
router ever built (a reference model's too); here the model's own routers are walked, and each
gets the column of its global decoder layer, cut to the tokens this rank's router sees.

Which tokens a router sees: the packed row, split zigzag over context-parallel ranks
(:class:`~vlm_models.megatron.context_parallel.ZigzagLayout`), then under sequence parallelism
this tensor-parallel rank's contiguous slice of that (the MoE layer routes before dispatching
over expert-parallel ranks, so EP changes nothing).

``REPLAY_FORWARD`` reads the current target at every router call, so a layer recomputed in
backward (activation recompute) routes to the same experts when its backward follows its
forward with no other micro-batch's forward in between: one pipeline stage. The pipeline's
1F1B schedule runs other forwards first; that case is refused by the trainer's config.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor, nn

from vlm_models.megatron.context_parallel import ZigzagLayout


def replay_routers(model: nn.Module) -> dict[int, TopKRouter]:
    """This stage's routers that can replay, by global decoder layer (0-based)."""
    found = {}
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            router = getattr(module.mlp, "router", None)
            if isinstance(router, TopKRouter) and router.router_replay is not None:
                found[module.layer_number - 1] = router
    return found


def local_routes(
    ids: Tensor, *, zigzag: ZigzagLayout | None = None, sequence_parallel: bool = False
) -> Tensor:
    """This rank's rows of a packed row's ids ``[T, layers, k]``: its zigzag part (padding
    slots get experts ``0..k-1``, valid and distinct), then its sequence-parallel slice."""
    if zigzag is not None:  # a padding slot's source is row token T, one past the row
        filler = torch.arange(ids.shape[2], dtype=ids.dtype, device=ids.device)
        padded = torch.cat([ids, filler.expand(1, *ids.shape[1:])])
        ids = padded.index_select(0, zigzag.local_source)
    if sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        if ids.shape[0] % tp:
            raise ValueError(f"{ids.shape[0]} tokens do not split over tp={tp}")
        ids = ids.chunk(tp)[rank]
    return ids


def set_routes(routers: dict[int, TopKRouter], ids: Tensor) -> None:
    """Every router to its layer's column of ``ids`` (this rank's rows, :func:`local_routes`)
    until :func:`clear_routes`."""
    for layer, router in routers.items():
        if layer >= ids.shape[1] or ids.shape[2] != router.topk:
            raise ValueError(
                f"routed expert ids {tuple(ids.shape)} for layer {layer} of top-{router.topk}"
            )
        replay = router.router_replay
        assert replay is not None
        replay.set_target_indices(ids[:, layer].long().contiguous())  # gather takes int64
        # set_target_indices also queues the ids for REPLAY_BACKWARD, which is never used
        # here; kept, the queue would hold every micro-batch's ids until the step ends
        replay.replay_backward_list.clear()
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(routers: dict[int, TopKRouter]) -> None:
    """Every router back to its own top-k, its ids dropped."""
    for router in routers.values():
        replay = router.router_replay
        assert replay is not None
        replay.clear_indices()
        replay.clear_router_replay_action()
