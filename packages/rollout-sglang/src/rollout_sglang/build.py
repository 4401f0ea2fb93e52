"""``build_engine``: the rollout engine a :class:`~rollout_sglang.config.RolloutConfig` asks
for, several behind an :class:`~rollout_sglang.router.EngineRouter` when it asks for more than one.

``backend="auto"`` uses SGLang when it is installed and the transformers engine otherwise; a
log line says which one runs. Asking for SGLang explicitly where it is missing raises an
ImportError that says how to install it.

Apart from the settings (``config.py``), which the engines and the router import: the settings
import nothing they build. Each engine is imported here only when it is built (torch,
transformers, sglang), so ``from rollout_sglang import build_engine`` stays light.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rollout_sglang.config import Backend, RolloutConfig

if TYPE_CHECKING:
    import torch

    from rollout_sglang.types import RolloutEngine
    from rollout_sglang.validation import RequestLimits

logger = logging.getLogger(__name__)


def resolve_backend(backend: Backend) -> Backend:
    """The backend that will run: "auto" resolved; an SGLang backend checked to be installed."""
    from rollout_sglang.sglang_client.common import INSTALL_HINT, sglang_available

    if backend == "auto":
        if sglang_available():
            return "sglang"
        logger.info("sglang is not installed: using the transformers HFEngine (%s)", INSTALL_HINT)
        return "hf"
    # "sglang-server" with server_urls talks HTTP and needs no local sglang; launching a
    # server checks for it in SGLangServer.
    if backend == "sglang" and not sglang_available():
        raise ImportError(f"rollout backend {backend!r} requested but {INSTALL_HINT}")
    if backend not in ("sglang", "sglang-server", "hf"):
        raise ValueError(f"unknown rollout backend {backend!r}: auto, sglang, sglang-server or hf")
    return backend


def _model_config(config: RolloutConfig, model_config: Any | None) -> Any | None:
    if model_config is None:
        try:
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(config.model_path)
        except Exception:  # not a local/hub model with a config: the server checks for itself
            return None
    return model_config


def routing_shape(config: RolloutConfig, model_config: Any | None) -> tuple[int, int] | None:
    """(decoder layers, experts per token) of the routing SGLang returns, when asked for and
    the model routes (its ``routed_experts`` rows are flat int32: this shapes them)."""
    if not config.return_routed_experts or model_config is None:
        return None
    text = model_config.get_text_config()
    k = getattr(text, "num_experts_per_tok", None)
    if not k or not getattr(text, "num_experts", None):
        return None
    return int(text.num_hidden_layers), int(k)


def _limits(config: RolloutConfig, model_config: Any | None) -> RequestLimits | None:
    if model_config is None:
        return None
    return config.sglang_config().limits(
        image_token_id=model_config.image_token_id,
        merge_size=model_config.vision_config.spatial_merge_size,
    )


def build_engine(config: RolloutConfig, *, model: torch.nn.Module | None = None) -> RolloutEngine:
    """Build the rollout engine ``config`` asks for. ``model``: the HF engine's model (built
    from ``config.model_path`` with ``vlm_models.build_model`` when not given)."""
    import torch

    from rollout_sglang.router import EngineRouter
    from rollout_sglang.sglang_client.client import SGLangClient
    from rollout_sglang.sglang_client.engine import SGLangEngine
    from rollout_sglang.sglang_client.server import SGLangServer

    backend = resolve_backend(config.backend)
    if backend == "hf":
        # imports transformers: only when built
        from rollout_sglang.hf.engine import ENGINE_MODEL_OPTIONS, HFEngine

        if model is None:
            from vlm_models.build import build_model

            dtype = getattr(torch, config.dtype)
            model = build_model(
                config.model_path,
                dtype=dtype,
                attn_implementation=config.attn_implementation,
                device=config.device,
                **ENGINE_MODEL_OPTIONS,
            )
        if config.num_engines > 1:
            logger.warning("num_engines=%d ignored by the HF engine", config.num_engines)
        return HFEngine(model, device=config.device, **config.hf_engine_options())

    model_config = _model_config(config, getattr(model, "config", None))
    limits = _limits(config, model_config)
    routing = routing_shape(config, model_config)
    names = config.weight_name_check()
    client = {
        "limits": limits,
        "routing_shape": routing,
        "tp_size": config.tp_size,
        "weight_names": names,
        "deterministic": config.enable_deterministic_inference,
    }
    if backend == "sglang":
        engines = [
            SGLangEngine(
                config.sglang_config(i),
                limits=limits,
                flatten_buckets=config.flatten_buckets,
                weight_names=names,
                routing_shape=routing,
            )
            for i in range(config.num_engines)
        ]
    elif config.server_urls:
        engines = [SGLangClient(url, **client) for url in config.server_urls]
    else:
        engines = [
            SGLangClient(server=SGLangServer(config.sglang_config(i)), **client)
            for i in range(config.num_engines)
        ]
    return engines[0] if len(engines) == 1 else EngineRouter(engines, config.router_policy)
