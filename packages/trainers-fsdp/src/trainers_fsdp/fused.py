"""Fused replacements for elementwise-heavy transformers modules, checked against the originals.

transformers' Qwen3 RMSNorm upcasts the whole activation to float32 and runs about eight
separate kernels forward (cast, pow, mean, add, rsqrt, mul, cast, mul) and more backward. A
Qwen3-VL decoder layer has four of them (input, post-attention, per-head q and k norms), so on
8k tokens they are a large share of the step's memory traffic and kernel launches.
``torch.nn.functional.rms_norm`` computes the same thing (float32 accumulation) in one fused
kernel each way on CUDA. The only numerical difference: the normalised activation is not
rounded to bf16 before the weight multiply (one rounding instead of two).

Each module class is swapped only after a probe shows the fused forward equals the original on
a random input, so a norm with another formula (e.g. ``(1 + weight)`` scaling) is left alone.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from vlm_models.vision_attention import replace_forwards

logger = logging.getLogger(__name__)


def _fused_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` in one kernel (float32 inside, input dtype out)."""
    weight = self.weight
    if weight.dtype != hidden_states.dtype:  # e.g. fp32 weight on bf16 input: keep HF's rule
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


@torch.no_grad()
def _probe(module: nn.Module) -> bool:
    """True when the fused forward matches the class's own (float32, random input and weight)."""
    cls = type(module)
    dim = module.weight.shape[0]
    probe = cls.__new__(cls)
    nn.Module.__init__(probe)
    probe.weight = nn.Parameter(torch.rand(dim, dtype=torch.float32) + 0.5)
    probe.variance_epsilon = module.variance_epsilon
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
    try:
        expected = cls.forward(probe, x)
    except Exception as err:  # an unknown norm: leave it as it is
        logger.debug("RMSNorm probe of %s failed: %s", cls.__name__, err)
        return False
    got = _fused_rms_norm_forward(probe, x)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-6)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` whose formula the probe confirms the fused forward.

    Parameters and names are unchanged (only the instance's ``forward`` is replaced), so
    checkpoints, FSDP and weight export see the same module. Returns how many were fused.
    """
    return replace_forwards(model, _is_rms_norm, _probe, _fused_rms_norm_forward, "RMSNorm")
