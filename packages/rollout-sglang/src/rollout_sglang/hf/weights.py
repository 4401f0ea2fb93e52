"""Weight sync on the receiving side: HF-named tensors, in buckets, into a live model.

The trainer streams ``(name, tensor)`` pairs named as in the HF checkpoint (that is also how
the transformers model names its parameters; the fast patch embedding of ``vlm_models`` keeps
the Conv3d parameter, so ``...patch_embed.proj.weight`` arrives and lands with its 5-D shape).
Buckets are made on the sending side by ``weight_sync.iter_weight_buckets``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

# Checkpoint layouts that differ from the module names of transformers 5 Qwen3-VL.
_PREFIX_ALIASES = (
    ("model.language_model.", "model."),
    ("model.", "model.language_model."),
    ("visual.", "model.visual."),
)


class WeightLoader:
    """Copies HF-named tensors into ``model``'s parameters and buffers in place.

    In place (``param.copy_``) keeps every reference valid: the KV-cache-free engine, compiled
    graphs and optimizer-free inference modules see the new values without a rebuild. Tied
    parameters are reachable under each of their names.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._targets: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self._targets.update(dict(model.named_buffers(remove_duplicate=False)))

    def target(self, name: str) -> Tensor:
        if name in self._targets:
            return self._targets[name]
        for old, new in _PREFIX_ALIASES:
            if name.startswith(old) and (alias := new + name[len(old) :]) in self._targets:
                return self._targets[alias]
        raise KeyError(f"weight update: {name!r} is not a parameter or buffer of the rollout model")

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Load one bucket; returns how many tensors were copied."""
        count = 0
        for name, tensor in named_tensors:
            dst = self.target(name)
            src = tensor
            if src.shape != dst.shape:
                # Only a patch embedding may arrive flat (a Linear-style export of the Conv3d);
                # anything else with a different shape would load scrambled, so it fails.
                if src.numel() != dst.numel() or not name.endswith("patch_embed.proj.weight"):
                    raise ValueError(
                        f"weight update: {name!r} has shape {tuple(src.shape)}, the model "
                        f"expects {tuple(dst.shape)}"
                    )
                src = src.reshape(dst.shape)  # e.g. a patch embedding stored flat
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype), non_blocking=True)
            count += 1
        return count
