"""rollout_sglang: rollout engines for GRPO behind one protocol.

:class:`HFEngine` (transformers, runs anywhere), :class:`SGLangEngine` (in-process
``sglang.Engine``), :class:`SGLangClient` (an SGLang server over HTTP, optionally launched by
:class:`SGLangServer`), :class:`EngineRouter` (data-parallel rollout over several engines) and
:func:`build_engine`, which picks SGLang when it is installed and the transformers engine
otherwise. sglang is an optional extra: nothing here imports it until an SGLang engine is built.
The transformers engine lives in :mod:`rollout_sglang.hf`, the SGLang client in
:mod:`rollout_sglang.sglang_client`; weight sync (the transports, the name check) is the
``weight_sync`` package's, and :func:`choose_weight_transport` picks one for a layout.

Only the settings and `build_engine` import here; engines and types are imported from their
modules (``from rollout_sglang.hf.engine import HFEngine``): the transformers engine imports
transformers (seconds), and a launcher parses its flags without it.
"""

from rollout_sglang.build import build_engine, resolve_backend
from rollout_sglang.config import RolloutConfig

__all__ = ["RolloutConfig", "build_engine", "resolve_backend"]
