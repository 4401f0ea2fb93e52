"""Weight sync on the receiving side: HF-named tensors, in buckets, into a live model.

The trainer streams ``(name, tensor)`` pairs in the one wire layout: the checkpoint files'
names and shapes as SGLang's loaders read them (``vlm_models.weights.to_wire_layout``).
Mostly that is how the transformers model names its parameters (the fast patch embedding of
``vlm_models`` keeps the Conv3d parameter, so ``...patch_embed.proj.weight`` lands with its
5-D shape); MoE experts differ, and are converted here into transformers' stacked experts:
Qwen3.5-MoE sends ``experts.{e}.gate_proj/up_proj/down_proj.weight``, copied into expert
``e``'s rows of ``gate_up_proj`` (gate first, as transformers' ``MergeModulelist`` +
``Concatenate(dim=1)`` builds it) and ``down_proj``; Qwen3-VL-MoE sends the released
transposed stacks, transposed back. transformers' own loading conversion is not used: it needs
every expert of a layer at once (a bucket may end anywhere) and its ``Transpose(check_dims)``
cannot tell a square expert's two layouts apart. Buckets are made on the sending side by
``weight_sync.iter_weight_buckets``.

:class:`DroppedWeights` is the engine's side of a release without a host copy: the parameters
it freed, and whether the pushes since have written every one back.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from vlm_models.weights import EXPERT_STACKS, released_expert_transpose

logger = logging.getLogger(__name__)

# Checkpoint layouts that differ from the module names of transformers 5 Qwen3-VL.
_PREFIX_ALIASES = (
    ("model.language_model.", "model."),
    ("model.", "model.language_model."),
    ("visual.", "model.visual."),
)
# one expert's tensor of a per-expert checkpoint (Qwen3.5-MoE)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


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
        self._transpose_experts = released_expert_transpose(model)
        #: when a set: the storages (``data_ptr`` of each written tensor's storage) loads
        #: wrote into, for an engine that must know its dropped weights all came back
        self.written: set[int] | None = None

    def target(self, name: str) -> Tensor:
        if name in self._targets:
            return self._targets[name]
        for old, new in _PREFIX_ALIASES:
            if name.startswith(old) and (alias := new + name[len(old) :]) in self._targets:
                return self._targets[alias]
        raise KeyError(f"weight update: {name!r} is not a parameter or buffer of the rollout model")

    def destination(self, name: str, tensor: Tensor) -> tuple[Tensor, Tensor]:
        """(the tensor or view of one to copy into, the source in its layout) for one wire
        tensor: an expert's slice of a stacked parameter, a transposed stack, or as sent."""
        if (match := _PER_EXPERT.match(name)) and name not in self._targets:
            base, expert, proj = match.group(1), int(match.group(2)), match.group(3)
            if proj == "down_proj":
                return self.target(f"{base}.down_proj")[expert], tensor
            stacked = self.target(f"{base}.gate_up_proj")[expert]
            half = stacked.shape[0] // 2
            return (stacked[:half] if proj == "gate_proj" else stacked[half:]), tensor
        dst = self.target(name)
        if self._transpose_experts and name.endswith(EXPERT_STACKS):
            return dst, tensor.transpose(1, 2)
        return dst, tensor

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Load one bucket; returns how many tensors were copied."""
        count = 0
        for name, tensor in named_tensors:
            dst, src = self.destination(name, tensor)
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
            if self.written is not None:
                self.written.add(dst.untyped_storage().data_ptr())
            count += 1
        return count


class DroppedWeights:
    """A model's parameters freed without a copy at an engine's release (``weights_backup`` off:
    the next weight push rewrites them all, as SGLang's release does without
    ``enable_weights_cpu_backup``), and the check before a generate that the push wrote every one
    back. Beside :class:`WeightLoader` because the loader's ``written`` is how the check knows;
    the loader is passed to each call rather than held, so this adds no reference to it."""

    def __init__(self) -> None:
        self.params: list[tuple[nn.Parameter, torch.Size]] = []  # (and their shapes)

    def drop(self, loader: WeightLoader) -> None:
        """Free every parameter of the loader's model without a copy. Buffers (rotary
        frequencies) are not pushed, so they stay."""
        if not self.params:  # (else dropped before: allocated again, maybe not refilled)
            params = dict.fromkeys(loader.model.parameters())  # tied ones once
            self.params = [(p, p.shape) for p in params]
        for p, _ in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        loader.written = None

    def allocate(self, loader: WeightLoader, device: torch.device) -> None:
        """Device memory for the dropped parameters, unfilled until the push writes them."""
        for p, shape in self.params:
            p.data = torch.empty(shape, dtype=p.dtype, device=device)
        loader.written = set()

    def check_refilled(self, loader: WeightLoader) -> None:
        """After a release without a backup, generating before every parameter was pushed
        again would sample from uninitialised memory: refuse, naming one."""
        if not self.params:
            return
        written = loader.written or set()
        missing = [p for p, _ in self.params if p.untyped_storage().data_ptr() not in written]
        if missing:
            names = {id(p): n for n, p in loader.model.named_parameters()}
            raise RuntimeError(
                f"HFEngine: {len(missing)} of {len(self.params)} parameters were dropped at "
                f"release_memory and not pushed since (first: {names.get(id(missing[0]))}); "
                "push the weights before generating, or keep a host copy (weights_backup)"
            )
        self.params, loader.written = [], None
