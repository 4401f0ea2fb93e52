"""rollout_sglang: rollout engines for GRPO behind one protocol.

:class:`HFEngine` (transformers, runs anywhere), :class:`SGLangEngine` (in-process
``sglang.Engine``), :class:`SGLangClient` (an SGLang server over HTTP, optionally launched by
:class:`SGLangServer`), :class:`EngineRouter` (data-parallel rollout over several engines) and
:func:`build_engine`, which picks SGLang when it is installed and the transformers engine
otherwise. sglang is an optional extra: nothing here imports it until an SGLang engine is built.
"""

from rollout_sglang.config import RolloutConfig, build_engine, resolve_backend
from rollout_sglang.cuda_ipc import CudaIpc, CudaIpcTransport
from rollout_sglang.hf_engine import HFEngine
from rollout_sglang.router import EngineRouter
from rollout_sglang.sglang_engine import (
    INSTALL_HINT,
    SGLangClient,
    SGLangConfig,
    SGLangEngine,
    SGLangServer,
    require_sglang,
    sglang_available,
)
from rollout_sglang.sglang_protocol import (
    encode_image,
    generate_payload,
    parse_output,
    sampling_params_payload,
)
from rollout_sglang.types import (
    Completion,
    FinishReason,
    GenerateRequest,
    NamedTensors,
    RolloutEngine,
    SamplingParams,
)
from rollout_sglang.validation import RequestLimits, request_error
from rollout_sglang.weight_names import WeightNameCheck, check_weight_names, sglang_param_name
from rollout_sglang.weight_sync import (
    DistributedWeightSender,
    EngineTransport,
    LinkedEngine,
    Nccl,
    WeightTransport,
    choose_weight_transport,
    init_weight_sync_group,
)
from rollout_sglang.weights import WeightLoader

__all__ = [
    "INSTALL_HINT",
    "Completion",
    "CudaIpc",
    "CudaIpcTransport",
    "DistributedWeightSender",
    "EngineRouter",
    "EngineTransport",
    "FinishReason",
    "GenerateRequest",
    "HFEngine",
    "LinkedEngine",
    "NamedTensors",
    "Nccl",
    "RequestLimits",
    "RolloutConfig",
    "RolloutEngine",
    "SGLangClient",
    "SGLangConfig",
    "SGLangEngine",
    "SGLangServer",
    "SamplingParams",
    "WeightLoader",
    "WeightNameCheck",
    "WeightTransport",
    "build_engine",
    "check_weight_names",
    "choose_weight_transport",
    "encode_image",
    "generate_payload",
    "init_weight_sync_group",
    "parse_output",
    "request_error",
    "require_sglang",
    "resolve_backend",
    "sampling_params_payload",
    "sglang_available",
    "sglang_param_name",
]
