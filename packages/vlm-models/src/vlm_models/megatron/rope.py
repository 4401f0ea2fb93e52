"""Qwen3-VL's interleaved 3-D M-RoPE, in Megatron's rotary-embedding layout.

Megatron-Core's ``MultimodalRotaryEmbedding`` follows Qwen2-VL: the rotary frequency pairs are
split into three contiguous sections (t, then h, then w). Qwen3-VL interleaves them instead:
pair ``i`` takes its position from axis ``i % 3`` while that axis still has pairs left in
``mrope_section`` (``[24, 20, 20]`` -> t h w t h w ... and the tail is t), the rest from t. This
module builds that layout and returns what Megatron's attention consumes: rotation angles of
shape ``[S, B, 1, head_dim]`` (non-interleaved rotate-half halves, as HF uses).
"""

from __future__ import annotations

import torch
from torch import nn


def interleaved_mrope_angles(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int]
) -> torch.Tensor:
    """Rotation angles ``[B, S, head_dim]`` for ``position_ids[3, B, S]`` (float32)."""
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"position_ids must be [3, batch, seq], got {tuple(position_ids.shape)}")
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device, torch.float32)
    angles = freqs[0].clone()  # [B, S, head_dim / 2], temporal everywhere to start
    for axis, offset in ((1, 1), (2, 2)):  # height, width
        idx = slice(offset, mrope_section[axis] * 3, 3)
        angles[..., idx] = freqs[axis, ..., idx]
    return torch.cat((angles, angles), dim=-1)


class InterleavedMRoPE(nn.Module):
    """Drop-in for ``GPTModel.rotary_pos_emb`` when ``position_embedding_type == "mrope"``.

    Called as ``rope(position_ids[3, B, S], mrope_section, cp_group=None)``, as GPTModel does;
    one angle row per token given, so a context-parallel rank passes its own tokens' positions.
    The inverse frequencies are computed exactly as transformers computes them, on the CPU in
    float32, so both models rotate by identical angles.
    """

    def __init__(self, head_dim: int, rotary_base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(
        self,
        position_ids: torch.Tensor,
        mrope_section: list[int],
        cp_group: torch.distributed.ProcessGroup | None = None,
    ) -> torch.Tensor:
        # under context parallelism position_ids are already this rank's tokens' (the model
        # splits them with the row), so cp_group changes nothing here
        angles = interleaved_mrope_angles(position_ids, self.inv_freq, mrope_section)
        return angles.transpose(0, 1)[:, :, None, :].contiguous()  # [S, B, 1, head_dim]
