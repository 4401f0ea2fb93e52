"""A fix for a megatron-core 0.16.1 bug hit by MoE models without Transformer Engine.

``megatron/core/transformer/moe/moe_utils.py`` imports ``te_general_gemm`` from Transformer
Engine inside ``try``, and its ``except ImportError`` branch never defines the name; the router's
``RouterGatingLinearFunction`` then tests ``te_general_gemm is not None`` and raises
``NameError`` on every MoE forward without TE (CPU and GPU alike). :func:`define_missing_te_gemm`
defines the name as None, which is the value that code expects when TE is absent, so the router
takes its plain ``torch`` matmul path. It changes nothing when TE is installed.
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
