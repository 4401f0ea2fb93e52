"""The actor's one config: model source, parallelism, precision, micro-batching, optimizer."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any

from rl_algos import GrpoLossConfig
from rl_algos.optimizer import OptimConfig
from rl_algos.run_context import ModelShape, ParallelLayout, RunContext, StateBytes, TrainLayout
from trainers_fsdp.memory import resident_bytes as memory_resident_bytes
from trainers_fsdp.memory import state_bytes as memory_state_bytes


@dataclass
class FsdpConfig:
    """Everything :class:`~trainers_fsdp.FsdpActor` needs.

    ``model`` is anything :func:`vlm_models.build_model` takes: a preset name
    (``"qwen3-vl-tiny"``, ``"qwen3-vl-2b"``: random init), a local HF folder, a hub id or a
    config object. Dtypes are names (``"bfloat16"``) so the config stays plain data.

    Fields with a help text are a launcher's settings (`rl_runtime.parse_config`);
    :meth:`for_run` fills in the rest for one run. Each trainer rank builds the actor
    from it (``actor_class()(config)``, :mod:`trainers_fsdp.build`); this module imports no actor.
    """

    model: Any = "qwen3-vl-tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # "packed": varlen attention within sample boundaries (trainers_fsdp.attention);
    # "sdpa" / "flash_attention_2": transformers' own (packed by position ids).
    attn_implementation: str = field(
        default="packed", metadata={"help": "trainer attention (packed | sdpa | ...)"}
    )
    vision_attn_implementation: str = "sdpa"
    freeze_vision: bool = field(default=False, metadata={"help": "keep the vision tower frozen"})
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    param_dtype: str | None = field(  # compute dtype; None: bfloat16 on CUDA, float32 on CPU
        default=None, metadata={"help": "compute dtype (default: bfloat16 on GPU, fp32 on CPU)"}
    )
    reduce_dtype: str = "float32"  # gradient reduce-scatter dtype (master weights stay float32)
    # In a world of one there is nothing to shard: the model trains without FSDP, bf16
    # compute weights over flat float32 masters (trainers_fsdp.master). True wraps it in FSDP
    # anyway (the root only, see shard_layers), as a reference.
    shard_single_rank: bool = False
    # Several ranks without FSDP: each holds the whole model as a world of one does (flat bf16
    # weights over float32 masters) and the gradients are averaged by one all-reduce before
    # they are read (norm, update). For models whose weights, gradients and AdamW state fit on
    # one GPU (the 2B model peaks at ~58 GiB): no per-layer gathers, no DTensor optimizer.
    replicate: bool = field(
        default=False,
        metadata={
            "help": "on several GPUs: each holds the whole model (bf16 over float32 masters) and "
            "one all-reduce averages the gradients, instead of FSDP sharding; for models that "
            "fit on one GPU",
            "flag": "fsdp_replicate",
        },
    )
    # ZeRO-3 (True) or keep params gathered from forward to backward (False); None: True when
    # there is more than one rank (a world of one saves nothing by resharding).
    reshard_after_forward: bool | None = None
    # FSDP units per decoder layer / vision block (True) or the root only (False); None: per
    # layer when there is more than one rank or the module is CPU-offloaded, else root only
    # (one gather and one reduce per step instead of one per layer; see parallelize.apply_fsdp).
    shard_layers: bool | None = None
    # RMSNorm as one fused torch kernel instead of transformers' float32 elementwise chain
    # (build_model(fused_rms_norm=True): vlm_models.rms_norm); off gives transformers' forward.
    fused_rms_norm: bool = True
    # Qwen3-VL vision attention with bf16 rotary and one varlen kernel for all images, with no
    # host sync per block (build_model(fused_vision_attention=True)); off gives transformers' own (one sdpa per
    # image after a cu_seqlens read in every block).
    fused_vision_attention: bool = True
    activation_checkpointing: bool = False
    # rollout routing replay (MoE): every forward routes each token to the experts the engine
    # chose (TrainBatch.routed_experts), weighted by this model's own router probabilities
    # there (vlm_models.routing_replay); a batch without them routes as the model does
    routing_replay: bool = False
    # torch.compile each decoder layer / vision block (not of a CPU-offloaded reference model),
    # and the log-prob / entropy chunk kernels; None: on CUDA for dense Qwen3-VL
    # (parallelize.compile_by_default), otherwise off
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each decoder layer, vision block and the log-prob kernels "
            "(default: on GPU for dense Qwen3-VL, otherwise off)"
        },
    )
    max_tokens_per_gpu: int = field(  # micro-batch token budget (dynamic batch size)
        default=16384, metadata={"help": "micro-batch token budget per GPU", "ge": 1}
    )
    temperature: float = 1.0  # the rollout's sampling temperature, for log-probs
    # "loss": run the LM head only on rows that predict loss tokens (log-probs elsewhere are 0,
    # as the token alignment convention allows); "all": every position.
    logprobs_scope: str = "loss"
    grpo: GrpoLossConfig = field(default_factory=GrpoLossConfig)
    sft_loss_agg_mode: str = "token-mean"
    optim: OptimConfig = field(
        default_factory=OptimConfig,
        metadata={"help": "AdamW and the learning-rate schedule of the run's training steps"},
    )
    # torch's fused AdamW kernel; None: on CUDA
    fused_adamw: bool | None = None
    # One rank with bf16 master weights: the whole update as one compiled pass per group over
    # the flat buffers (trainers_fsdp.flat_adamw); off: torch's AdamW per tensor, then a cast
    # pass. None: on CUDA (on the CPU the uncompiled pass is slower than torch's foreach).
    flat_update: bool | None = None
    # the fraction of the float32 masters and AdamW moments kept and stepped in host memory
    # (trainer_core.host_adamw); set by for_run from the layout (the launchers'
    # --optimizer-cpu-offload, chosen to fit). One GPU or `replicate` only.
    optimizer_offload: float = 0.0
    # torch threads of that host step (None: every core the process may use)
    host_optimizer_threads: int | None = field(
        default=None,
        metadata={
            "help": "threads of the optimizer step on the host under --optimizer-cpu-offload "
            "(default: every core the trainer may use)",
            "ge": 1,
        },
    )
    reference_model: bool = False  # keep a frozen copy of the initial weights for KL
    offload_reference: bool = True  # reference params live in CPU memory (gathered per layer)
    log_entropy: bool = True  # entropy metric in train_step (no gradient unless entropy_coef)
    export_dtype: str = "bfloat16"  # dtype of iter_hf_weights / export_hf tensors
    seed: int = 0
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_tokens_per_gpu <= 0:
            raise ValueError(f"max_tokens_per_gpu must be positive, got {self.max_tokens_per_gpu}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.logprobs_scope not in ("loss", "all"):
            raise ValueError(f"logprobs_scope must be 'loss' or 'all', got {self.logprobs_scope!r}")
        if not 0.0 <= self.optimizer_offload <= 1.0:
            raise ValueError(
                f"optimizer_offload must be within [0, 1], got {self.optimizer_offload}"
            )

    def machine_refusal(self, *, use_gpu: bool) -> str | None:
        """Why a setting cannot work here (see ``rl_runtime.protocols.TrainerConfig``)."""
        if self.attn_implementation != "flash_attention_2":
            return None
        if not use_gpu:
            return (
                "--attn-implementation flash_attention_2 runs on CUDA only and this run has no "
                "GPU; use packed (the default) or sdpa"
            )
        if importlib.util.find_spec("flash_attn") is None:
            return (
                "--attn-implementation flash_attention_2: flash-attn is not installed "
                "(pip install flash-attn); packed (the default) needs nothing more"
            )
        return None

    def supports(self, layout: ParallelLayout, world_size: int | None = None) -> str | None:
        """Why FSDP cannot run ``layout`` on ``world_size`` trainer ranks (None: not known yet),
        naming the flag (it shards instead of splitting layers or experts, recomputes whole
        layers or nothing, and steps the optimizer on the host only unsharded); None when it
        can."""
        if layout.tp > 1 or layout.sp:
            return (
                "--tensor-parallel / --sequence-parallel are for --backend megatron; "
                "the fsdp backend shards instead"
            )
        if max(layout.pp, layout.ep) > 1:
            return "--pipeline-parallel / --expert-parallel are for --backend megatron"
        if layout.cp > 1:
            return "--context-parallel is for --backend megatron (fsdp: no CP)"
        if layout.etp is not None:
            return "--expert-tensor-parallel is for --backend megatron"
        if layout.recompute == "selective":
            return "--recompute selective is for --backend megatron (fsdp: full or none)"
        if layout.optimizer_offload > 0:
            return offload_refusal(
                replicate=self.replicate,
                shard_single_rank=self.shard_single_rank,
                world_size=world_size or 1,
            )
        return None

    def state_bytes(
        self, shape: ModelShape, layout: TrainLayout, *, vision_patches_per_token: float = 0.25
    ) -> StateBytes:
        """Per-GPU memory of a step on ``layout`` (trainers_fsdp.memory)."""
        return memory_state_bytes(
            shape,
            layout,
            replicate=self.replicate,
            vision_patches_per_token=vision_patches_per_token,
            reference=self.reference_placement(layout),
        )

    def resident_bytes(self, shape: ModelShape, layout: TrainLayout) -> float:
        """Per-GPU memory the actor keeps while a colocated engine generates, after its
        ``release_cache`` (trainers_fsdp.memory.resident_bytes): what the colocation plan sizes
        the engine's KV cache beside."""
        return memory_resident_bytes(
            shape,
            layout,
            replicate=self.replicate,
            fsdp_one_rank=self.shard_single_rank and not self.replicate,
            reference=self.reference_placement(layout),
        )

    def placement(self, world_size: int, *, trainable: bool, on_gpu: bool = True) -> str:
        """Where a rank holds one model copy: "host" (a GPU run's frozen reference under
        ``offload_reference``: FSDP2's CPU offload), "whole" (no FSDP: one rank, or
        replicated, unless ``shard_single_rank``) or "sharded". The one rule both
        ``ModelBuilder.build`` and the memory plan (trainers_fsdp.memory) follow."""
        if not trainable and self.offload_reference and on_gpu:
            return "host"
        whole = world_size == 1 or self.replicate  # every rank holds the whole model
        return "whole" if whole and not self.shard_single_rank else "sharded"

    def reference_placement(self, layout: TrainLayout) -> str | None:
        """Where a GPU run holds the frozen reference model (:meth:`placement`), None
        without one."""
        if not self.reference_model:
            return None
        return self.placement(layout.world_size, trainable=False)

    def describe_layout(self, layout: TrainLayout) -> list[str]:
        """How the ranks hold the model, for a layout's one-line description."""
        how = "replicated" if self.replicate or layout.world_size == 1 else "sharded"
        return [f"fsdp {how} over {layout.world_size} GPU(s)"]

    def layout_flags(self, layout: TrainLayout) -> list[str]:
        """The launcher flags that select this backend and ``layout`` (recompute and tokens
        are the launcher's own)."""
        return ["--backend fsdp"] + ["--fsdp-replicate"] * self.replicate

    def for_run(self, run: RunContext) -> FsdpConfig:
        """This config completed for one run: what a launcher settles (the model, the layout,
        which must be one FSDP runs: see :meth:`supports`) and what the loop sets (sampling
        temperature, loss, schedule length, a phase's own schedule: ``OptimConfig.for_run``)."""
        refusal = self.supports(run.layout)
        if refusal:
            raise ValueError(refusal)
        return replace(
            self,
            model=run.model,
            seed=run.seed,
            device="cuda" if run.use_gpu else "cpu",
            activation_checkpointing=run.layout.recompute == "full",
            optimizer_offload=run.layout.optimizer_offload,
            temperature=run.temperature,
            grpo=self.grpo if run.grpo is None else run.grpo,
            reference_model=run.reference_model,
            routing_replay=run.routing_replay,
            optim=self.optim.for_run(run.total_steps, run.schedule),
        )


def offload_refusal(*, replicate: bool, shard_single_rank: bool, world_size: int) -> str | None:
    """Why the optimizer cannot be stepped on the host: that is the flat masters' step, which
    needs the parameters whole on each rank (one rank, or ``replicate``); None when it can."""
    if (world_size > 1 and not replicate) or shard_single_rank:
        return (
            "optimizer offload (--optimizer-cpu-offload) on the fsdp backend needs one GPU or "
            "--fsdp-replicate: sharded FSDP holds 1/N of the optimizer state per GPU instead "
            "(or use --backend megatron)"
        )
    return None
