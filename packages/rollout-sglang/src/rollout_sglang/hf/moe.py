"""The sparse MoE block of Qwen3-VL-MoE / Qwen3.5-MoE for the decode step, over the model's own
stacked expert parameters.

Why not transformers' experts loop: it finds the experts hit with ``nonzero`` and loops over them
in Python, a host sync per layer, so it can be neither fast at small batch nor captured as a CUDA
graph. Here routing is a fixed sequence of tensor ops:

* :func:`route`: router linear, softmax in float32, top-k, renormalised (both models' routers
  renormalise; a config with ``norm_topk_prob=False`` turns it off), cast back.
* :func:`experts_dense` (CPU, and the reference): every expert evaluated for every row, each
  weighted by its routing probability (zero for the experts not chosen). Exact and capturable,
  ``E / k`` times the expert FLOPs of a sparse evaluation.
* :func:`experts_grouped` (CUDA where ``torch._grouped_mm`` exists; ``auto`` takes it for bf16
  weights, the kernel's dtype): the ``B * k`` (row, expert) pairs sorted by expert, one grouped
  GEMM per projection with per-expert group ends from a ``searchsorted`` of the sorted ids (on
  the device: no host sync), scattered back and summed per row.

Both read ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``
themselves (never copies), so in-place weight updates are seen. The shared expert (Qwen3.5-MoE:
a SwiGLU MLP gated by ``sigmoid(shared_expert_gate(x))``) is added when the block has one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def is_moe(mlp: nn.Module) -> bool:
    """True for a sparse MoE block laid out as transformers' Qwen3-VL-MoE / Qwen3.5-MoE ones."""
    experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    return (
        experts is not None
        and isinstance(getattr(experts, "gate_up_proj", None), Tensor)
        and isinstance(getattr(experts, "down_proj", None), Tensor)
        and isinstance(getattr(gate, "weight", None), Tensor)
        and hasattr(gate, "top_k")
    )


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The grouped-GEMM path: CUDA and bf16 (CPU takes the dense form, the reference)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def route(
    x: Tensor, router_weight: Tensor, top_k: int, renormalise: bool, ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(weights ``[B, k]`` in ``x``'s dtype, expert ids ``[B, k]``), as the model's router;
    ``ids`` given: those experts, weighted by their probabilities (routing replay)."""
    logits = F.linear(x, router_weight)
    probs = logits.softmax(-1, dtype=torch.float32)
    if ids is None:
        top, ids = torch.topk(probs, top_k, dim=-1)
    else:
        top = probs.gather(-1, ids)
    if renormalise:
        top = top / top.sum(-1, keepdim=True)
    return top.to(logits.dtype), ids


def experts_dense(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Every expert on every row, weighted by its routing weight (zero when not chosen)."""
    num_experts = gate_up.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device)
    dense = dense.scatter(1, ids, weights)  # [B, E]
    gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, B, I] each
    out = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # [E, B, H]
    return (out * dense.T[:, :, None].to(out.dtype)).sum(0)


def experts_grouped(
    x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """The chosen experts only: (row, expert) pairs sorted by expert, two grouped GEMMs.

    ``torch._grouped_mm(a [N, K], b [E, K, M], offs)`` multiplies the rows of group ``e``
    (``offs[e-1]:offs[e]``, int32 cumulative ends) by ``b[e]``; an expert with no rows is an
    empty group. Sizes are fixed (``B * k`` rows), so the step stays capturable."""
    batch, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat_sorted, order = torch.sort(ids.reshape(-1), stable=True)
    # group ends: pairs with expert <= e (not bincount: on CUDA it reads the max on the host)
    experts = torch.arange(num_experts, device=ids.device, dtype=flat_sorted.dtype)
    offs = torch.searchsorted(flat_sorted, experts, right=True).to(torch.int32)
    rows = x[order // top_k]  # [B*k, H], grouped by expert
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # [B*k, H]
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return (unsorted.view(batch, top_k, -1) * weights[:, :, None].to(out.dtype)).sum(1)


def moe_forward(
    mlp: nn.Module,
    x: Tensor,
    *,
    grouped: bool,
    renormalise: bool = True,
    trace: dict[str, Tensor] | None = None,
    record: Tensor | None = None,
) -> Tensor:
    """The block's output for ``x`` [B, H] (the post-attention-normed hidden states).
    ``trace`` (eager steps, the log-prob microscope): receives the chosen expert ids; its
    ``"replay"`` ids, when present, are routed to instead of the router's own choice.
    ``record`` ``[B, k]`` (a view of a static buffer, so a captured graph writes it too):
    receives the chosen ids, which the engine returns for routing replay in the trainer."""
    replay = None if trace is None else trace.get("replay")
    weights, ids = route(x, mlp.gate.weight, int(mlp.gate.top_k), renormalise, ids=replay)
    if trace is not None:
        trace["experts"] = ids
    if record is not None:
        record.copy_(ids)
    experts = mlp.experts
    run = experts_grouped if grouped else experts_dense
    out = run(x, weights, ids, experts.gate_up_proj, experts.down_proj)
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        s = F.linear(
            F.silu(F.linear(x, shared.gate_proj.weight)) * F.linear(x, shared.up_proj.weight),
            shared.down_proj.weight,
        )
        gate = getattr(mlp, "shared_expert_gate", None)
        if gate is not None:
            s = torch.sigmoid(F.linear(x, gate.weight)) * s
        out = out + s
    return out
