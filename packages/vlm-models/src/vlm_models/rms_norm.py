"""RMSNorm in one fused kernel (``F.rms_norm``), for norms whose formula it matches.

transformers' Qwen3 RMSNorm upcasts the whole activation to float32 and runs about eight
separate kernels forward (cast, pow, mean, add, rsqrt, mul, cast, mul) and more backward. A
Qwen3-VL decoder layer has four of them (input, post-attention, per-head q and k norms), so on
8k tokens they are a large share of the step's memory traffic and kernel launches.
``torch.nn.functional.rms_norm`` computes the same thing (float32 accumulation) in one fused
kernel each way on CUDA. The only numerical difference: the normalised activation is not
rounded to bf16 before the weight multiply (one rounding instead of two).

A transformers class runs :class:`FusedRMSNorm` only after :meth:`FusedRMSNorm.layout_matches`
showed both forwards equal on a random input, so a norm with another formula (e.g.
``(1 + weight)`` scaling, Qwen3.5's) keeps its own. ``build_model(fused_rms_norm=True)``; the
FSDP trainer turns it on.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from vlm_models.classes import Ours

logger = logging.getLogger(__name__)


class FusedRMSNorm(Ours, nn.Module):
    """Mixin before a transformers RMSNorm with ``weight`` (1-D) and ``variance_epsilon``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``weight * x / sqrt(mean(x^2) + eps)`` in one kernel (float32 inside, input dtype out)."""
        weight = self.weight
        if weight.dtype != hidden_states.dtype:  # e.g. fp32 weight on bf16 input: keep HF's rule
            return super().forward(hidden_states)
        return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)

    @classmethod
    @torch.no_grad()
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        """True when our forward matches ``theirs`` (float32, random input and weight)."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
            return False
        dim = weight.shape[0]
        probe = theirs.__new__(theirs)
        nn.Module.__init__(probe)
        probe.weight = nn.Parameter(torch.rand(dim, dtype=torch.float32) + 0.5)
        probe.variance_epsilon = eps
        x = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
        try:
            expected = theirs.forward(probe, x)
        except Exception as err:  # an unknown norm: leave it as it is
            logger.debug("RMSNorm probe of %s failed: %s", theirs.__name__, err)
            return False
        probe.__class__ = cls
        got = probe(x)
        return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-6)
