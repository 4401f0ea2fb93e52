"""The FSDP actor's models, built at start-up: a transformers model with activation
checkpointing, compile and FSDP applied (:mod:`trainers_fsdp.parallelize`), or, where every
rank holds it whole, placed on the device over float32 masters (:mod:`trainers_fsdp.master`).

Apart from the actor because it runs once, before any step, and decides from the settings and
the layout alone; what it decides stays on :class:`ModelBuilder` for the actor to keep (the
compile choice, each model's vision inputs, the policy's masters).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainers_fsdp.attention import PACKED_ATTENTION, register_packed_attention
from trainers_fsdp.config import FsdpConfig, offload_refusal
from trainers_fsdp.master import MasterWeights
from trainers_fsdp.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    compile_by_default,
    mixed_precision_policy,
)
from trainers_fsdp.vision import VisionInputs
from vlm_models.build import build_model
from vlm_models.routing_replay import replay_routers

logger = logging.getLogger(__name__)


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a setting names (``"bfloat16"``); None for None."""
    return None if name is None else getattr(torch, name)


def check_offload(
    config: FsdpConfig, *, world_size: int, param_dtype: torch.dtype | None, device: torch.device
) -> None:
    """The optimizer on the host (``optimizer_offload``) is the flat masters' step: one rank
    or ``replicate``, low-precision compute (float32 on the CPU: already on the host)."""
    refusal = offload_refusal(
        replicate=config.replicate,
        shard_single_rank=config.shard_single_rank,
        world_size=world_size,
    )
    if refusal:  # the launcher refuses it before anything starts; a direct build here
        raise ValueError(refusal)
    if param_dtype in (None, torch.float32):
        logger.info("float32 compute on %s: the optimizer runs where it is", device)


class ModelBuilder:
    """Builds the actor's policy and reference models with its settings on this rank's layout
    (``param_dtype``: the compute dtype, None for float32)."""

    def __init__(
        self,
        config: FsdpConfig,
        device: torch.device,
        mesh: DeviceMesh,
        world_size: int,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.config = config
        self.device = device
        self.mesh = mesh
        self.world_size = world_size
        self.param_dtype = param_dtype
        self.compile = config.compile  # None: decided by the model built (compile_by_default)
        self.vision_inputs: dict[int, VisionInputs | None] = {}  # by id(model)
        self.masters: MasterWeights | None = None  # one rank, low-precision compute

    def build(self, *, trainable: bool) -> nn.Module:
        """The policy (``trainable``) or the frozen reference, on this rank's layout."""
        cfg = self.config
        if cfg.attn_implementation == PACKED_ATTENTION:
            register_packed_attention()
        torch.manual_seed(cfg.seed)  # identical init on every rank before sharding
        on_gpu = self.device.type == "cuda"
        placement = cfg.placement(self.world_size, trainable=trainable, on_gpu=on_gpu)
        offload = placement == "host"
        single = placement == "whole"  # no FSDP
        compute = self.param_dtype or torch.float32
        model = build_model(
            cfg.model,
            dtype=torch.float32,
            # without FSDP a lower compute dtype gets flat float32 masters (or a cast): a
            # checkpoint stored in it loads as it is, not widened first
            narrow_dtype=compute if single and compute != torch.float32 else None,
            attn_implementation=cfg.attn_implementation,
            vision_attn_implementation=cfg.vision_attn_implementation,
            freeze_vision=cfg.freeze_vision,
            fused_rms_norm=cfg.fused_rms_norm,
            fused_vision_attention=cfg.fused_vision_attention,
            sync_free=True,  # counts are checked on the host, in build_micro_batch
            packed_linear_attention=True,  # Qwen3.5: recurrent state reset at sample boundaries
            routing_replay=cfg.routing_replay,
            **cfg.model_overrides,
        )
        model.config.use_cache = False
        if cfg.routing_replay and not replay_routers(model):
            raise ValueError(
                f"routing_replay needs an MoE model; {model.config.model_type} has no routers"
            )
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        self.vision_inputs[id(model)] = VisionInputs.attach(model)
        if trainable and cfg.activation_checkpointing:
            apply_ac(model)
        if self.compile is None:
            self.compile = compile_by_default(self.device, model.config)
        # An offloaded reference copies each unit's weights in as it runs, so compiling it
        # gains little, and FSDP's offload hooks inside compiled calls were never measured.
        if self.compile and not offload:
            apply_compile(model)
        if single:
            return self._place_single_rank(model, trainable=trainable)
        mp = mixed_precision_policy(self.param_dtype, torch_dtype(cfg.reduce_dtype))
        apply_fsdp(
            model,
            self.mesh,
            mp,
            reshard_after_forward=(
                self.world_size > 1
                if cfg.reshard_after_forward is None
                else cfg.reshard_after_forward
            ),
            cpu_offload=offload,
            shard_layers=(
                self.world_size > 1 or offload if cfg.shard_layers is None else cfg.shard_layers
            ),
        )
        if not offload:
            model.to(self.device)
        return model

    def _place_single_rank(self, model: nn.Module, *, trainable: bool) -> nn.Module:
        """A world of one, without FSDP: float32 parameters stay as they are; a lower compute
        dtype gets float32 masters (trainable) or a plain cast (reference). Buffers (rotary
        frequencies) keep their dtype, as under FSDP's mixed precision."""
        compute = self.param_dtype or torch.float32
        if trainable and compute != torch.float32:
            offload = self.config.optimizer_offload
            self.masters = MasterWeights(model, compute, self.device, host_fraction=offload)
        else:
            for p in model.parameters():
                p.data = p.data.to(self.device, compute)
        return model.to(self.device)
