"""Fused RMSNorm: the same outputs and gradients as transformers' norms, unknown formulas kept."""

from __future__ import annotations

import torch
from torch import nn

from trainers_fsdp.fused import fuse_rms_norms


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
    n = fuse_rms_norms(fused)
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


def test_norm_with_other_formula_is_left_alone():
    model = nn.Sequential(OnePlusRMSNorm(8))
    assert fuse_rms_norms(model) == 0
    assert "forward" not in vars(model[0])


def test_fused_vision_attention_matches_transformers(make_plain_model, batch):
    """Two images in one vision forward: same features and gradients, with the host lengths
    given (no device read) or not."""
    from trainers_fsdp.fused import fuse_vision_attention, vision_lengths, vision_seqlens

    plain, fused = make_plain_model(), make_plain_model()
    depth = fused.config.vision_config.depth
    assert fuse_vision_attention(fused) == depth
    pixels = torch.cat([batch.pixel_values[0], batch.pixel_values[2]])
    grid = torch.cat([batch.image_grid_thw[0], batch.image_grid_thw[2]])

    def run(model, lengths=None):
        model.zero_grad()
        with vision_seqlens(lengths):
            out = model.model.visual(pixels, grid_thw=grid)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out[0]
        feats = torch.cat(feats) if isinstance(feats, (list, tuple)) else feats
        feats.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return feats.detach(), grads

    ref, ref_grads = run(plain)
    for lengths in (None, vision_lengths(grid)):
        got, grads = run(fused, lengths)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)
