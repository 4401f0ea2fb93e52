"""rollout_sglang: rollout engines for GRPO behind one protocol.

:class:`HFEngine` (transformers, runs anywhere), :class:`SGLangEngine` (in-process
``sglang.Engine``), :class:`SGLangServerEngine` (a launched or existing SGLang server over HTTP),
:class:`EngineRouter` (data-parallel rollout over several engines) and :func:`build_engine`,
which picks SGLang when it is installed and the transformers engine otherwise. sglang is an
optional extra: nothing here imports it until an SGLang engine is built.
"""

from rollout_sglang.hf_engine import HFEngine
from rollout_sglang.types import (
    Completion,
    FinishReason,
    GenerateRequest,
    NamedTensors,
    RolloutEngine,
    SamplingParams,
)
from rollout_sglang.validation import RequestLimits, request_error
from rollout_sglang.weights import WeightLoader

__all__ = [
    "Completion",
    "FinishReason",
    "GenerateRequest",
    "HFEngine",
    "NamedTensors",
    "RequestLimits",
    "RolloutEngine",
    "SamplingParams",
    "WeightLoader",
    "request_error",
]
