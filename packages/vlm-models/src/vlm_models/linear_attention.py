"""Packed rows for linear-attention layers: each sample's recurrent state starts fresh.

Qwen3.5's gated-delta-net layers (``*GatedDeltaNet``) carry two kinds of state along the row: a
short causal ``conv1d`` over the q/k/v projections and the delta rule's recurrent state. In a
packed row (samples end to end) transformers' forward carries both across sample boundaries, so
a sample's outputs depend on the samples before it. :class:`PackedGatedDeltaNet` (the model
files' gated delta net, ``build_model(packed_linear_attention=True)``) has a forward that takes
the sample boundaries as the ``packed_seq_info``
keyword (anything with ``cu_seqlens``, an int tensor ``[n + 1]``, and ``lengths``, Python ints;
the FSDP actor's ``PackedSeqInfo``) and keeps each sample to itself:

- ``varlen`` (CUDA, where transformers runs both real kernels: flash-linear-attention's
  ``chunk_gated_delta_rule`` and the ``causal_conv1d`` package): one call over the row, the delta
  rule given ``cu_seqlens`` and the convolution ``seq_idx``, so both reset at each boundary
  (not yet run on a GPU: neither package is on the benchmark machine);
- ``per-sample`` (otherwise, the torch reference path on the CPU included): the layer's own
  forward once per sample, outputs concatenated. The full-attention layers stay packed.

Without ``packed_seq_info`` (or with one sample) the layer runs transformers' forward unchanged.
:func:`~vlm_models.supports_packed_forward` on the model then says the packed forward is exact.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from vlm_models.classes import Ours

logger = logging.getLogger(__name__)

_logged: set[str] = set()


class SampleBoundaries(Protocol):
    """What the packed forward needs to know about a row's samples."""

    cu_seqlens: Tensor  # int [n + 1], starting at 0, on the compute device
    lengths: tuple[int, ...]  # the same boundaries as Python ints (no host sync to split)


def is_linear_attention(module: nn.Module) -> bool:
    """A gated-delta-net token mixer (Qwen3.5 dense and MoE)."""
    return type(module).__name__.endswith("GatedDeltaNet")


def has_linear_attention(config: Any) -> bool:
    """Whether a config (or a model's) has linear-attention layers."""
    config = getattr(config, "config", config)
    text = getattr(config, "text_config", config)
    return "linear_attention" in (getattr(text, "layer_types", None) or [])


def linear_state_bytes(config: Any, dtype_bytes: int = 2) -> int:
    """Bytes one sequence's states take in a rollout engine, summed over the linear-attention
    layers (0 without any): per gated-delta-net layer its conv window ``conv_dim x kernel`` in
    the engine's dtype (``dtype_bytes``: bf16) and its float32 recurrent state ``v_heads x
    k_dim x v_dim``, ``conv_dim`` being the q, k and v projections' width. What the
    transformers engine holds per slot (``rollout_sglang.hf.linear_attention_decode.
    LinearStates.bytes_per_slot``) and the colocation plan counts per sequence
    (``rl_runtime.ModelShape.state_bytes_per_sequence``)."""
    config = getattr(config, "config", config)
    text = getattr(config, "text_config", config)
    layers = sum(t == "linear_attention" for t in getattr(text, "layer_types", None) or [])
    if not layers:
        return 0
    k_dim, v_dim = text.linear_key_head_dim, text.linear_value_head_dim
    v_heads = text.linear_num_value_heads
    conv_dim = 2 * text.linear_num_key_heads * k_dim + v_heads * v_dim
    conv = conv_dim * text.linear_conv_kernel_dim * dtype_bytes
    return layers * (conv + 4 * v_heads * k_dim * v_dim)


def linear_attention_packs(model: nn.Module) -> bool:
    """True when every linear-attention layer of ``model`` resets its state at sample
    boundaries (runs :class:`PackedGatedDeltaNet`), and the model has at least one."""
    layers = [m for m in model.modules() if is_linear_attention(m)]
    return bool(layers) and all(isinstance(m, PackedGatedDeltaNet) for m in layers)


def _real_kernel(fn: Any) -> bool:
    """Whether transformers resolved a ``use_kernel_func_from_hub_with_fallback`` function to
    its package's kernel rather than the torch reference (read from the wrapper's closure;
    False when it cannot tell, which selects the per-sample path, always exact)."""
    while fn is not None:
        try:
            nonlocals = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):
            return False
        if "is_new_implementation" in nonlocals:
            return bool(nonlocals["is_new_implementation"])
        fn = getattr(fn, "__wrapped__", None)
    return False


def varlen_kernels(layer: nn.Module | type) -> bool:
    """Whether ``layer`` (or transformers' class of it) can reset at boundaries in one call:
    its module runs fla's delta rule
    and the ``causal_conv1d`` kernel (both take boundaries: ``cu_seqlens``, ``seq_idx``) and its
    forward hands them on (it passes ``cu_seq_lens_q`` to the delta rule and its keywords to
    the convolution, as transformers 5.17 and 5.19 do)."""
    cls = _transformers_class(layer if isinstance(layer, type) else type(layer))
    return _varlen_kernels(cls)


def _transformers_class(cls: type) -> type:
    """The first class of ``cls``' MRO defined by transformers (ours add only methods)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("transformers.")), cls)


@functools.cache
def _varlen_kernels(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    names = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
    if module is None or not all(_real_kernel(getattr(module, n, None)) for n in names):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return (
        "cu_seq_lens_q" in source
        and re.search(r"causal_conv1d_fn\((?:[^()]|\([^()]*\))*\*\*kwargs", source) is not None
    )


def _log_once(path: str, layer: nn.Module) -> None:
    if path not in _logged:
        _logged.add(path)
        logger.info(
            "packed %s: state reset at sample boundaries by the %s path", type(layer).__name__, path
        )


def _call_passes_keywords(owner: nn.Module, attr: str) -> bool:
    """Whether ``owner``'s forward calls ``self.<attr>(...)`` with its ``**kwargs``, so the
    ``packed_seq_info`` keyword reaches the layer (the decoder layers of transformers 5.17 and
    5.19 do)."""
    try:
        source = inspect.getsource(type(owner).forward)
    except (OSError, TypeError):
        return False
    call = rf"self\.{re.escape(attr)}\((?:[^()]|\([^()]*\))*\*\*kwargs"
    return re.search(call, source) is not None


class PackedGatedDeltaNet(Ours, nn.Module):
    """Mixin before transformers' ``*GatedDeltaNet``: with ``packed_seq_info`` each sample's
    state starts from zero; without it, transformers' forward unchanged."""

    def forward(
        self,
        hidden_states: Tensor,  # [1, T, hidden]
        *args: Any,
        packed_seq_info: SampleBoundaries | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """The layer's forward over a packed row, each sample's state starting from zero."""
        forward = super().forward
        lengths = tuple(packed_seq_info.lengths) if packed_seq_info is not None else ()
        if len(lengths) <= 1:
            return forward(hidden_states, *args, **kwargs)
        if args or kwargs.get("cache_params") is not None or hidden_states.shape[0] != 1:
            raise ValueError(
                f"{type(self).__name__}: a packed row is one sequence ([1, T, hidden]) without a "
                f"cache, got hidden_states {tuple(hidden_states.shape)}"
            )
        if sum(lengths) != hidden_states.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: sample lengths sum to {sum(lengths)}, "
                f"the row has {hidden_states.shape[1]} tokens"
            )
        mask = kwargs.pop("attention_mask", None)  # a 2-D padding mask; a packed row has none
        if hidden_states.is_cuda and mask is None and varlen_kernels(type(self)):
            _log_once("varlen", self)
            cu = packed_seq_info.cu_seqlens
            counts = (cu[1:] - cu[:-1]).to(torch.int64)
            ids = torch.arange(len(lengths), device=cu.device, dtype=torch.int32)
            seq_idx = ids.repeat_interleave(counts, output_size=hidden_states.shape[1])[None]
            return forward(
                hidden_states, cu_seq_lens_q=cu.to(torch.int64), seq_idx=seq_idx, **kwargs
            )
        _log_once("per-sample", self)
        parts = hidden_states.split(list(lengths), dim=1)
        masks = [None] * len(parts) if mask is None else mask.split(list(lengths), dim=1)
        outs = [forward(parts[i], attention_mask=masks[i], **kwargs) for i in range(len(parts))]
        return torch.cat(outs, dim=1)

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        """Whether the decoder layer holding it hands on the forward's keywords (else
        ``packed_seq_info`` would never arrive and the state would not reset)."""
        return parent is not None and _call_passes_keywords(parent, name)


def float32_inputs(kernel: Any) -> Any:
    """``kernel`` (transformers' chunked delta rule: fla's on a GPU that has it, else the torch
    reference) given float32 q, k, v and beta, its output cast back to v's dtype."""

    @functools.wraps(kernel)
    def run(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        dtype = value.dtype
        if dtype == torch.float32:
            return kernel(query, key, value, *args, **kwargs)
        if kwargs.get("beta") is not None:
            kwargs["beta"] = kwargs["beta"].float()
        out, state = kernel(query.float(), key.float(), value.float(), *args, **kwargs)
        return out.to(dtype), state

    run.float32_inputs = True  # type: ignore[attr-defined]
    return run


def delta_rule_modules(model: nn.Module) -> list[Any]:
    """The transformers modules whose chunked delta rule (``torch_chunk_gated_delta_rule``,
    called by name at each forward) ``model``'s gated-delta-net layers run."""
    names = {
        _transformers_class(type(layer)).__module__
        for layer in model.modules()
        if is_linear_attention(layer)
    }
    found = [sys.modules.get(name) for name in sorted(names)]
    return [m for m in found if m is not None and hasattr(m, "torch_chunk_gated_delta_rule")]


def use_float32_delta_rule(model: nn.Module, on: bool = True) -> list[str]:
    """Run the chunked delta rule of ``model``'s gated-delta-net layers on float32 inputs (``on``
    False: in the inputs' dtype again); returns the names of the modules changed.

    Why: fla's ``chunk_gated_delta_rule`` keeps its per-chunk states and runs its dots in the
    inputs' dtype, so bf16 q/k/v round the recurrence at every chunk, while the engine's decode
    step (``rollout_sglang.hf.linear_attention_decode``) carries a float32 state. On the H100
    that rounding parted the Qwen3.5 cut's forward from the engine's decode at layer 0
    (relative 4.2e-3 in bf16; docs/benchmarks/2026-12-05-logprob-microscope.md). The torch
    reference computes in float32 already but L2-normalises q/k in the inputs' dtype first.
    Every side builds through :func:`~vlm_models.build.build_model`, which calls this, so the
    engine's prefill and the FSDP trainer run the same rule (the Megatron layer gives fla
    float32 inputs itself). The change is the module's: every model of that class in the
    process runs it."""
    changed = []
    for module in delta_rule_modules(model):
        kernel = module.torch_chunk_gated_delta_rule
        if getattr(kernel, "float32_inputs", False) == on:
            continue
        module.torch_chunk_gated_delta_rule = float32_inputs(kernel) if on else kernel.__wrapped__
        changed.append(module.__name__)
        logger.info(
            "%s: the chunked delta rule runs on %s",
            module.__name__,
            "float32 q, k, v" if on else "the inputs' dtype",
        )
    return changed
