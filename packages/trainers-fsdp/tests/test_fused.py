"""Fused RMSNorm: the same outputs and gradients as transformers' norms, unknown formulas kept."""

from __future__ import annotations

import torch
from torch import nn

from vlm_models.classes import Swap, select_classes
from vlm_models.rms_norm import FusedRMSNorm


class OnePlusRMSNorm(nn.Module):
    """A norm with ``(1 + weight)`` scaling (as some Qwen variants): must stay unfused."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight) * x32.to(x.dtype)


def test_fused_model_matches_transformers_forward_and_backward(make_plain_model, batch):
    plain, fused = make_plain_model(), make_plain_model()
    n = select_classes(fused, fused_rms_norm=True)["fused_rms_norm"]
    layers = fused.config.text_config.num_hidden_layers
    assert n == 4 * layers + 1  # input, post-attention, q and k norms per layer, final norm
    for model in (plain, fused):
        model.train()
        model.zero_grad()
    kwargs = dict(
        input_ids=batch.input_ids[0][None],
        pixel_values=batch.pixel_values[0],
        image_grid_thw=batch.image_grid_thw[0],
    )
    kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == plain.config.image_token_id).int()
    outs = []
    for model in (plain, fused):
        logits = model(**kwargs).logits
        logits.square().mean().backward()
        outs.append(logits)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    for name, p in fused.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-4)


class FusedOnePlusRMSNorm(FusedRMSNorm, OnePlusRMSNorm):
    """What a model file would list for it: its layout check must refuse."""


def test_norm_with_other_formula_is_left_alone():
    model = nn.Sequential(OnePlusRMSNorm(8))
    table = [Swap("fused_rms_norm", OnePlusRMSNorm, FusedOnePlusRMSNorm)]
    assert select_classes(model, table=table, fused_rms_norm=True)["fused_rms_norm"] == 0
    assert type(model[0]) is OnePlusRMSNorm
