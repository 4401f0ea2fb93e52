"""Micro-batches through megatron-core's forward-backward schedules.

``get_forward_backward_func()`` picks the schedule for the pipeline layout: one stage runs the
micro-batches one after the other, several stages run the 1F1B schedule (activations and their
gradients passed between stages). The schedule owns the loop; the actor supplies how one stage
runs a micro-batch (``forward``) and, on the last stage, the micro-batch's loss (``loss``),
which is ``rl_algos.train_step``'s per-micro-batch loss callable.

The loss the schedule gets is already scaled for the global batch, so the model's
``TransformerConfig`` has ``calculate_per_token_loss=True`` (the schedule then divides by
nothing, DDP sums over data-parallel ranks instead of averaging) and the loss function returns
``(loss, 0 tokens, {})``; gradients are finalised by the actor, not the schedule
(``finalize_model_grads_func`` unset). Packed micro-batches differ in length, so pipeline
stages exchange each activation's shape first (:func:`schedule_config`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor


def schedule_config(pp: int) -> dict[str, Any]:
    """The ``TransformerConfig`` fields the schedules need (see the module docstring)."""
    return dict(calculate_per_token_loss=True, variable_seq_lengths=pp > 1)


# forward(mb, model) -> this stage's output: hidden states, or on the last stage log-probs [T]
StageForward = Callable[[Any, torch.nn.Module], Tensor]
# loss(mb, logprobs) -> the scalar to backward (last stage only)
StageLoss = Callable[[Any, Tensor], Tensor]


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    forward: StageForward,
    loss: StageLoss,
    *,
    forward_only: bool = False,
) -> None:
    """Run every micro-batch through ``model`` (this rank's stage) under the pipeline
    schedule; with ``forward_only`` no backward (``loss`` still sees each last-stage output)."""
    if not len(micro_batches):
        return
    no_tokens = torch.zeros((), dtype=torch.int)

    def step(data_iterator: Any, stage: torch.nn.Module) -> tuple[Tensor, Callable]:
        mb = next(data_iterator)
        output = forward(mb, stage)

        def loss_func(logprobs: Tensor) -> tuple[Tensor, Tensor, dict]:
            return loss(mb, logprobs), no_tokens, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=0,  # unused: shapes travel with each activation (variable_seq_lengths)
        micro_batch_size=1,
        forward_only=forward_only,
    )
