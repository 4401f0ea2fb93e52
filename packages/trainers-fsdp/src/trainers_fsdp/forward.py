"""The FSDP actor's forward pass: one packed micro-batch through the model, scored.

Apart from the actor because it is the one piece both of its passes share (``compute_logprobs``
and the train step's micro-batches) and it reads no state of the actor beyond its settings:
the model call with the sample boundaries and vision inputs, and the aligned log-prob (and
entropy) rows of the tokens the loss reads.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from rl_algos import (
    EntropyMode,
    aligned_entropy,
    aligned_logprobs,
    entropy_from_logits,
    logprobs_from_logits,
    scatter_rows,
)
from trainer_core import MicroBatch
from trainers_fsdp.attention import PACKED_ATTENTION, PackedSeqInfo
from trainers_fsdp.config import FsdpConfig
from trainers_fsdp.vision import VisionInputs


def packed_forward(
    model: nn.Module,
    mb: MicroBatch,
    config: FsdpConfig,
    *,
    vision: VisionInputs | None,
    linear_attention: bool,
    compiled: bool,
    entropy: EntropyMode = None,
) -> tuple[Tensor, Tensor | None]:
    """Packed forward; aligned log-probs ``[T]`` (float32) and optionally entropy ``[T]``.

    With ``logprobs_scope="loss"`` the LM head runs only on the rows that predict loss
    tokens (``logits_to_keep``), and other positions hold 0, which the token alignment
    convention allows. ``entropy``: None, ``"grad"`` (differentiable, for an entropy bonus)
    or ``"metric"`` (detached). ``vision``: the model's injected vision inputs (None: none);
    ``linear_attention``: the model has linear-attention layers, which take the sample
    boundaries too (their state resets there); ``compiled``: the log-prob rows' kernels.
    """
    kwargs = dict(
        input_ids=mb.input_ids[None],
        position_ids=mb.position_ids[:, None, :],
        use_cache=False,
    )
    if mb.pixel_values is not None:
        kwargs["pixel_values"] = mb.pixel_values
        kwargs["image_grid_thw"] = mb.image_grid_thw
    if config.attn_implementation == PACKED_ATTENTION or linear_attention:
        kwargs["packed_seq_info"] = PackedSeqInfo(mb.cu_seqlens, tuple(mb.lengths), max(mb.lengths))
    injected = nullcontext() if vision is None else vision.use(mb.vision_inputs)
    with record_function("fsdp_actor.forward"), injected:
        return _scored_forward(model, mb, kwargs, config, compiled, entropy)


def _scored_forward(
    model: nn.Module,
    mb: MicroBatch,
    kwargs: dict,
    config: FsdpConfig,
    compiled: bool,
    entropy: EntropyMode,
) -> tuple[Tensor, Tensor | None]:
    """The model call and the log-prob (and entropy) rows of :func:`packed_forward`."""
    temperature = config.temperature
    total = mb.input_ids.shape[0]
    if config.logprobs_scope == "all":
        logits = model(**kwargs).logits[0]
        cu = [0]
        for n in mb.lengths:
            cu.append(cu[-1] + n)
        logprobs = aligned_logprobs(logits, mb.input_ids, cu, temperature)
        ent = None
        if entropy == "grad":
            ent = aligned_entropy(logits, cu, temperature)
        elif entropy == "metric":
            with torch.no_grad():
                ent = aligned_entropy(logits.detach(), cu, temperature)
        return logprobs, ent

    positions = mb.loss_positions  # tokens whose log-prob is needed
    if positions.numel() == 0:  # nothing to score (dummy row): keep the graph, cheaply
        logits = model(**kwargs, logits_to_keep=1).logits[0]
        zero = logits.sum().float() * 0.0
        return torch.zeros(total, device=logits.device) + zero, None
    logits = model(**kwargs, logits_to_keep=positions - 1).logits[0]  # [R, V]
    rows = logprobs_from_logits(logits, mb.input_ids[positions], temperature, compiled=compiled)
    logprobs = scatter_rows(rows, positions, total)
    ent = None
    if entropy is not None:
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            src = logits if entropy == "grad" else logits.detach()
            ent_rows = entropy_from_logits(src, temperature, compiled=compiled)
            ent = scatter_rows(ent_rows, positions, total)
    return logprobs, ent
