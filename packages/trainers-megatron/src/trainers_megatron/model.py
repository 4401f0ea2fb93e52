"""The Megatron actor's model at start-up: what megatron-core's model is built with beyond the
model and the parallel layout (the schedules' ``TransformerConfig`` fields, activation
recompute, MoE, the gated-delta-net kernels), and the weights it starts from.

Apart from the actor because it runs once, before any step, and decides from the settings
alone (as :mod:`trainers_fsdp.model` builds the FSDP actor's models); the actor builds the
policy and its frozen reference with it, then wraps the policy in DDP
(:mod:`trainers_megatron.optim`).
"""

from __future__ import annotations

from typing import Any

import torch

from trainers_megatron.config import MegatronConfig
from trainers_megatron.schedule import schedule_config
from vlm_models.build import build_model
from vlm_models.megatron import SafetensorsReader, load_hf_weights
from vlm_models.presets import PRESETS


def model_settings(config: MegatronConfig) -> dict[str, Any]:
    """The keywords of ``build_megatron_model`` the actor's settings choose: the gated-delta-net
    kernels and the ``TransformerConfig`` fields of the schedules, recompute, grouped GEMM,
    routing replay and the first pipeline stage's layers."""
    overrides = dict(schedule_config(config.pp), **recompute_settings(config))
    overrides["moe_grouped_gemm"] = config.moe_grouped_gemm
    if config.routing_replay:
        overrides["moe_enable_routing_replay"] = True
    if config.pipeline_first_stage_layers is not None:
        overrides["num_layers_in_first_pipeline_stage"] = config.pipeline_first_stage_layers
    gdn = dict(gdn_path=config.linear_attention_kernels)
    return dict(**gdn, **overrides)


def recompute_settings(config: MegatronConfig) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``config.recompute`` (megatron-core's own
    activation recomputation)."""
    if config.recompute == "full":
        return dict(
            recompute_granularity="full",
            recompute_method=config.recompute_method,
            recompute_num_layers=config.recompute_num_layers,
        )
    if config.recompute == "selective":
        modules = (
            {}
            if config.recompute_modules is None
            else {"recompute_modules": list(config.recompute_modules)}
        )
        return dict(recompute_granularity="selective", **modules)
    return {}


def load_initial_weights(module: torch.nn.Module, config: MegatronConfig, hf_config: Any) -> None:
    """The folder's weights; random ones only for a preset name or a config object."""
    source = config.model
    if isinstance(source, str) and source not in PRESETS:
        with SafetensorsReader(source) as reader:
            load_hf_weights(module, reader)
        return
    torch.manual_seed(config.seed)  # the same random init on every rank
    hf = build_model(hf_config)
    load_hf_weights(module, hf.state_dict())
