"""Fixes for megatron-core 0.16.1 paths we take without Transformer Engine.

**MoE router.** ``megatron/core/transformer/moe/moe_utils.py`` imports ``te_general_gemm`` from Transformer
Engine inside ``try``, and its ``except ImportError`` branch never defines the name; the router's
``RouterGatingLinearFunction`` then tests ``te_general_gemm is not None`` and raises
``NameError`` on every MoE forward without TE (CPU and GPU alike). :func:`define_missing_te_gemm`
defines the name as None, which is the value that code expects when TE is absent, so the router
takes its plain ``torch`` matmul path. It changes nothing when TE is installed.

**Packed rotary embedding.** The unfused THD rotary path
(``models/common/embeddings/rope_utils.py``, ``_apply_rotary_pos_emb_thd``) reads
``cu_seqlens`` to the host (``.tolist()``, then one ``.item()`` per sample) for the query and
the key of every layer: on the H200 that was ~500 device syncs in one 2B training step of 8
packed samples, with the GPU idle for a third of the step. Our M-RoPE gives every packed token
its own frequencies (``freqs`` has one row per token), and without context parallelism the
per-sample slices it cuts then concatenate back to ``freqs`` itself; so
:func:`use_packed_rope_without_host_reads` rotates the whole packed tensor at once through the
same ``_apply_rotary_pos_emb_bshd`` arithmetic. Under context parallelism ``freqs`` already has
one row per token of this rank (the model splits the positions with the row), where
megatron-core's function would cut a CP share out of it a second time, so it goes the same
way. Any other call (fused RoPE, per-sample frequency tables) goes to megatron-core's
function unchanged.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def define_missing_te_gemm() -> None:
    """Give ``moe_utils.te_general_gemm`` its intended None when Transformer Engine is absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        logger.debug("megatron-core moe_utils: defined te_general_gemm = None (no TE)")


def use_packed_rope_without_host_reads() -> None:
    """Route attention's THD rotary calls whose ``freqs`` cover every token to one bshd call."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb
    if getattr(original, "_glimpse_packed", False):
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        one_row_per_token = freqs.dim() == 4 and freqs.size(0) == t.size(0)
        if cu_seqlens is not None and one_row_per_token and not config.apply_rope_fusion:
            return rope_utils._apply_rotary_pos_emb_bshd(
                t.unsqueeze(1),
                freqs,
                rotary_interleaved=config.rotary_interleaved,
                multi_latent_attention=config.multi_latent_attention,
                mscale=mscale,
            ).squeeze(1)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)

    apply_rotary_pos_emb._glimpse_packed = True  # type: ignore[attr-defined]
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def quiet_default_tp_group() -> None:
    """Let ``torch.compile`` trace megatron-core's parallel linears in one graph.

    ``RowParallelLinear.forward`` (``tensor_parallel/layers.py``) always passes ``tp_group=None``
    to ``linear_with_grad_accumulation_and_async_allreduce``, whose lookup
    (``utils.get_tensor_model_parallel_group_if_none``) then calls ``warnings.warn`` with keyword
    arguments on rank 0: a deprecation notice about megatron-core's own call, and a call dynamo
    cannot trace, so every compiled decoder layer broke its graph there. This lookup returns the
    same group without the notice.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "_glimpse_quiet", False):
        return

    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is not None or not parallel_state.is_initialized():
            return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(
                check_initialized=check_initialized
            )
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    get_tensor_model_parallel_group_if_none._glimpse_quiet = True  # type: ignore[attr-defined]
    layers.get_tensor_model_parallel_group_if_none = get_tensor_model_parallel_group_if_none
