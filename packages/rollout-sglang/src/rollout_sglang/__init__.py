"""rollout_sglang: rollout engines for GRPO behind one protocol.

:class:`HFEngine` (transformers, runs anywhere), :class:`SGLangEngine` (in-process
``sglang.Engine``), :class:`SGLangClient` (an SGLang server over HTTP, optionally launched by
:class:`SGLangServer`), :class:`EngineRouter` (data-parallel rollout over several engines) and
:func:`build_engine`, which picks SGLang when it is installed and the transformers engine
otherwise. sglang is an optional extra: nothing here imports it until an SGLang engine is built.
The transformers engine lives in :mod:`rollout_sglang.hf`, the SGLang client in
:mod:`rollout_sglang.sglang_client`; weight sync (the transports, the name check) is the
``weight_sync`` package's, and :func:`choose_weight_transport` picks one for a layout.

`RolloutConfig` imports at once; every other name loads its module on first use (the
transformers engine imports transformers, seconds), so a launcher parses its flags without them.
"""

import importlib
from typing import Any

from rollout_sglang.config import RolloutConfig, build_engine, resolve_backend

_EXPORTS: dict[str, tuple[str, ...]] = {
    "hf.engine": ("HFEngine",),
    "hf.weights": ("WeightLoader",),
    "launch": (
        "TRANSPORT_KINDS",
        "check_engines",
        "choose_weight_transport",
        "engine_factory",
        "build_hf_engine",
        "uses_sglang",
        "weight_transport",
    ),
    "router": ("EngineRouter",),
    "sglang_client.client": ("SGLangClient",),
    "sglang_client.common": (
        "INSTALL_HINT",
        "SGLangConfig",
        "require_sglang",
        "sglang_available",
    ),
    "sglang_client.engine": ("SGLangEngine",),
    "sglang_client.server": ("SGLangServer",),
    "sglang_client.protocol": (
        "encode_image",
        "generate_payload",
        "parse_output",
        "sampling_params_payload",
    ),
    "types": (
        "Completion",
        "FinishReason",
        "GenerateRequest",
        "NamedTensors",
        "RolloutEngine",
        "SamplingParams",
    ),
    "validation": (
        "RequestLimits",
        "request_error",
    ),
}
_LAZY = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name of `_EXPORTS`, imported once; afterwards a plain attribute."""
    module = _LAZY.get(name)
    if module is None:
        if name in globals():  # loaded by another thread meanwhile
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    _LAZY.pop(name, None)
    return value


__all__ = ["RolloutConfig", "build_engine", "resolve_backend", *_LAZY]
