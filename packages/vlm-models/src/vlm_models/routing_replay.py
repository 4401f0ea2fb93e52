"""Rollout routing replay (R3) for transformers' MoE models: route to the engine's experts.

The engine reports, for every token, the experts its router chose at each decoder layer. A
trainer that routes by itself flips some of those choices (near-equal router probabilities,
another kernel's rounding), and each flip moves the token's log-prob far more than the rest of
the engine/trainer gap. Replaying the engine's ids removes the flips; the weights stay the
trainer's own router probabilities at those ids (softmax in float32 over all experts, gathered,
renormalised over the ``k``, as the router does), so the router still gets its gradient.

:class:`ReplayRouter` is the router's subclass (the model files' ``routing_replay`` option);
:func:`set_routes` / :func:`clear_routes` (or the :func:`replaying` context) hand each MoE
layer its column of a packed row's ``[T, layers, k]`` ids. The ids stay set until cleared, so
an activation-checkpointed layer recomputed in backward routes the same way as its forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlm_models.classes import Ours


class ReplayRouter(Ours):
    """Transformers' top-k router (Qwen3.5-MoE, Qwen3-VL-MoE) that routes to ``replay_ids``
    ``[T, k]`` (LongTensor) while they are set; otherwise transformers' forward. Same return
    as transformers': ``(router_logits, router_scores, router_indices)``.

    The ids are a plain attribute (no buffer: state dicts stay transformers'). In a compiled
    decoder layer dynamo guards on whether it is None, so replay on and off are two graphs,
    each compiled once (the token count is dynamic)."""

    replay_ids: Tensor | None = None

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        weight = getattr(module, "weight", None)
        return (
            isinstance(weight, Tensor)
            and weight.dim() == 2
            and isinstance(getattr(module, "top_k", None), int)
            and getattr(module, "hidden_dim", None) == weight.shape[1]
        )

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ids = self.replay_ids
        if ids is None:
            return super().forward(hidden_states)  # type: ignore[misc]
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # type: ignore[attr-defined]
        if ids.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"routing replay: {ids.shape[0]} tokens of expert ids for "
                f"{hidden_states.shape[0]} tokens in the layer"
            )
        router_logits = F.linear(hidden_states, self.weight)  # type: ignore[attr-defined]
        probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        top = probs.gather(-1, ids)
        top = top / top.sum(dim=-1, keepdim=True)
        return router_logits, top.to(router_logits.dtype), ids


def replay_routers(model: nn.Module) -> dict[int, ReplayRouter]:
    """The model's :class:`ReplayRouter` modules by decoder layer index (layers without a
    sparse MoE block, e.g. ``mlp_only_layers``, have none)."""
    layers = model.get_decoder().layers  # type: ignore[operator]
    found = {}
    for index, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, ReplayRouter):
            found[index] = gate
    return found


def set_routes(model: nn.Module, ids: Tensor) -> None:
    """Route every MoE layer of ``model`` to its column of ``ids`` ``[T, layers, k]`` (a packed
    row's, on the model's device) until :func:`clear_routes`."""
    routers = replay_routers(model)
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no replaying routers: build it with "
            "build_model(routing_replay=True) (an MoE model)"
        )
    layers = len(model.get_decoder().layers)  # type: ignore[operator]
    if ids.dim() != 3 or ids.shape[1] != layers:
        raise ValueError(f"routed expert ids {tuple(ids.shape)}, expected [T, {layers}, top_k]")
    for index, router in routers.items():
        if ids.shape[2] != router.top_k:  # type: ignore[attr-defined]
            raise ValueError(
                f"routed expert ids give {ids.shape[2]} experts per token, layer {index} "
                f"routes to {router.top_k}"  # type: ignore[attr-defined]
            )
        router.replay_ids = ids[:, index].long().contiguous()  # gather and one_hot take int64


def clear_routes(model: nn.Module) -> None:
    """Every router of ``model`` back to its own top-k."""
    for router in replay_routers(model).values():
        router.replay_ids = None


@contextmanager
def replaying(model: nn.Module, ids: Tensor | None) -> Iterator[None]:
    """``model`` routed to ``ids`` (None: its own top-k) inside the block, cleared after."""
    if ids is None:
        yield
        return
    set_routes(model, ids)
    try:
        yield
    finally:
        clear_routes(model)
