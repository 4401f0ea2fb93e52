"""The experts an MoE model routed each token to, as the engine returns them for routing replay.

Why: the trainer recomputes every log-prob with its own forward, and a bf16 difference of one
rounding between the engine's decode step and that forward flips some tokens' top-k expert
choice; each flip changes the token's hidden state by far more than the rounding did, and the
flips multiply layer by layer (docs/reliability.md). Routing replay makes the trainer route to
the experts the engine chose. The layout is SGLang's (``return_routed_experts``, meta_info
``routed_experts``): ``[prompt + response - 1, layers, k]``, one row per token the engine ran
through the model (every prompt token and every response token but the last, which is sampled
and never fed back), one column per decoder layer (zeros at a layer without a sparse block).

The decode step writes its rows itself (``TextDecoder.routing``, graph-capturable); the prefill
runs transformers' forward, whose routers are read here with forward hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import numpy as np
import torch
from torch import Tensor, nn

from rollout_sglang.hf.moe import is_moe


class PrefillRouting:
    """Records the top-k expert ids of every router of ``layers`` during one prefill forward.

    transformers' Qwen3-VL-MoE / Qwen3.5-MoE routers return ``(logits, weights, ids)`` over the
    flattened ``[B * W, H]`` rows of a ``[B, W]`` batch."""

    def __init__(self, layers: Sequence[nn.Module], top_k: int) -> None:
        self.layers, self.top_k = list(layers), top_k
        self._ids: dict[int, Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> PrefillRouting:
        self._ids.clear()
        for i, layer in enumerate(self.layers):
            mlp = getattr(layer, "mlp", None)
            if is_moe(mlp):
                self._handles.append(mlp.gate.register_forward_hook(self._hook(i)))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def keep(module: nn.Module, args: object, out: tuple[Tensor, ...]) -> None:
            self._ids[layer] = out[-1]

        return keep

    def rows(self, batch: int, width: int, lengths: Sequence[int]) -> list[np.ndarray]:
        """Per batch row ``b``: its first ``lengths[b]`` tokens' ids ``[n, layers, k]`` int16."""
        ids = torch.zeros((batch, width, len(self.layers), self.top_k), dtype=torch.int16)
        for layer, chosen in self._ids.items():
            ids[:, :, layer] = chosen.reshape(batch, width, self.top_k).to("cpu", torch.int16)
        return [ids[b, :n].numpy() for b, n in enumerate(lengths)]


def sequence_routing(prompt: np.ndarray | None, decode: np.ndarray | None) -> Tensor | None:
    """One completion's ``[P + R - 1, layers, k]`` (SGLang's layout) from its prompt's rows and
    its decode steps' rows (none when the first sampled token ended it)."""
    if prompt is None:
        return None
    parts = [prompt] if decode is None or not len(decode) else [prompt, decode]
    return torch.from_numpy(np.concatenate(parts))
