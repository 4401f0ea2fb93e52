"""The packed rotary route equals megatron-core's own THD path and reads nothing to the host."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

from vlm_models.megatron._upstream_fixes import use_packed_rope_without_host_reads


class _OneRankGroup:
    """What rope_utils asks of a context-parallel group of one: its size and rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_packed_rope_equals_megatron_thd_without_host_reads():
    use_packed_rope_without_host_reads()
    use_packed_rope_without_host_reads()  # idempotent
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    t = torch.randn(20, 4, 16)
    freqs = torch.randn(20, 1, 1, 16)  # one row per packed token, as our M-RoPE gives
    expected = rope_utils._apply_rotary_pos_emb_thd(
        t, cu, freqs, rotary_interleaved=False, cp_group=_OneRankGroup()
    )
    reads = _HostReads()
    with reads:
        got = attention.apply_rotary_pos_emb(
            t, freqs, config=config, cu_seqlens=cu, cp_group=_OneRankGroup()
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert reads.count == 0
    # a per-sample frequency table (fewer rows than tokens) still takes megatron-core's path
    short = freqs[:8]
    torch.testing.assert_close(
        attention.apply_rotary_pos_emb(
            t, short, config=config, cu_seqlens=cu, cp_group=_OneRankGroup()
        ),
        rope_utils._apply_rotary_pos_emb_thd(
            t, cu, short, rotary_interleaved=False, cp_group=_OneRankGroup()
        ),
    )
