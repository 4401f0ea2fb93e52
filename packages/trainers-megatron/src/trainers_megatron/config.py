"""The Megatron actor's one config: model source, parallelism, precision, batching, optimizer."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rl_algos import GrpoLossConfig
from rl_algos.optimizer import OptimConfig
from rl_algos.run_context import ModelShape, ParallelLayout, RunContext, StateBytes, TrainLayout
from trainers_megatron.memory import state_bytes as memory_state_bytes

OFFLOAD_NEEDS_DISTRIBUTED = (
    "--optimizer-cpu-offload on the megatron backend needs the distributed optimizer "
    "(megatron-core's HybridDeviceOptimizer runs under its precision-aware form); drop "
    "--no-distributed-optimizer"
)


@dataclass
class MegatronConfig:
    """Everything :class:`~trainers_megatron.MegatronActor` needs.

    ``model`` is a preset name (random init from ``seed``), an HF folder with safetensors
    (streamed into the shards), a hub id (downloaded first; the launchers pass the folder) or a
    config object (random init). Anything else is an error, never a random model. Dtypes are
    names.

    Fields with a help text are a launcher's settings (`rl_runtime.parse_config`);
    :meth:`for_run` fills in the rest for one run. Each trainer rank builds the actor
    from it (``actor_class()(config)``, :mod:`trainers_megatron.build`); this module imports no actor.
    """

    model: Any = "qwen3-vl-tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    tp: int = 1  # tensor parallel
    sp: bool = False  # sequence parallel (needs tp > 1)
    # context parallel: each packed row's tokens split zigzag over this many ranks, which share
    # their samples (vlm_models.megatron.context_parallel)
    cp: int = 1
    pp: int = 1  # pipeline parallel: stages, run by megatron-core's 1F1B schedule
    # decoder layers on the first pipeline stage (None: an even split, or the fewest that hold
    # every deepstack layer when the even split does not)
    pipeline_first_stage_layers: int | None = None
    ep: int = 1  # expert parallel (MoE): experts split over this many data-parallel ranks
    etp: int | None = None  # expert tensor parallel: each expert's TP split (None: tp)
    # megatron-core's distributed optimizer: float32 masters and AdamW moments sharded over the
    # data-parallel ranks (False: every rank holds them whole)
    distributed_optimizer: bool = field(
        default=True,
        metadata={
            "help": "megatron-core's distributed optimizer (float32 masters and AdamW moments "
            "sharded over data-parallel ranks); --no-distributed-optimizer keeps them whole"
        },
    )
    # the fraction of the optimizer state (float32 masters, AdamW moments) kept and stepped in
    # host memory by megatron-core's HybridDeviceOptimizer (optimizer_cpu_offload, with its
    # precision-aware distributed optimizer); set by for_run from the layout (the launchers'
    # --optimizer-cpu-offload, chosen to fit). Needs the distributed optimizer.
    optimizer_offload: float = 0.0
    overlap_cpu_optimizer_d2h_h2d: bool = field(
        default=True,
        metadata={
            "help": "under --optimizer-cpu-offload: the host step in pieces, overlapped with "
            "the gradients' copies to the host and the weights' copies back (two CUDA streams; "
            "the FSDP backend's host step); off: megatron-core's own step, one tensor at a time"
        },
    )
    # torch threads of that host step (None: every core the process may use)
    host_optimizer_threads: int | None = field(
        default=None,
        metadata={
            "help": "threads of the optimizer step on the host under --optimizer-cpu-offload "
            "(default: every core the trainer may use)",
            "ge": 1,
        },
    )
    # the distributed optimizer's float32 masters as one tensor per gradient-bucket shard
    # (trainers_megatron.flat_masters): gradients attached once, one copy per bucket back to
    # the weights, clipping inside the fused AdamW; False: megatron-core's per-parameter path
    flat_masters: bool = True
    param_dtype: str | None = field(  # compute dtype; None: bfloat16 on CUDA, float32 on CPU
        default=None, metadata={"help": "compute dtype (default: bfloat16 on GPU, fp32 on CPU)"}
    )
    # activation recomputation (TransformerConfig.recompute_granularity): "full" recomputes
    # whole decoder layers (recompute_method / recompute_num_layers say which), "selective"
    # the parts in recompute_modules (None: megatron-core's default, core attention);
    # True / False mean "full" / "none"
    recompute: Literal["none", "selective", "full"] | bool = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] | None = None
    # rollout routing replay (MoE): every forward routes each token to the experts the engine
    # chose (TrainBatch.routed_experts), weighted by this model's own router scores there
    # (megatron-core's RouterReplay, vlm_models.megatron.routing_replay); a batch without them
    # routes as the model does
    routing_replay: bool = False
    # torch.compile each decoder layer (one function shared by all), each HF vision block and
    # the log-prob kernels, as the FSDP actor compiles its units. None: on CUDA for dense
    # Qwen3-VL (compiles_by_default). On the H200 (2026-12-02) the 2B shape's first compiled
    # step takes about 100 s and the trainer then runs at 0.95x the compiled FSDP actor
    # (eager: 0.72x); MoE and linear-attention layers were never measured compiled
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each decoder layer, vision block and the log-prob kernels "
            "(default: on GPU for dense Qwen3-VL, otherwise off)"
        },
    )
    # MoE experts as two grouped GEMMs per layer (torch._grouped_mm over the experts' own
    # parameters: vlm_models.megatron.experts.GroupedExperts); False: megatron-core's
    # SequentialMLP, one GEMM pair per expert (on the H200, Qwen3-VL-30B-A3B cut to 4
    # layers trained at 0.69x the FSDP actor that way, issue #35)
    moe_grouped_gemm: bool = field(
        default=True,
        metadata={
            "help": "MoE experts as grouped GEMMs (torch._grouped_mm); "
            "--no-moe-grouped-gemm runs one GEMM pair per expert"
        },
    )
    # Qwen3.5's gated-delta-net kernels: "fla" (flash-linear-attention, CUDA; varlen over
    # packed rows), "torch" (megatron-core's torch reference, per sample) or "auto" (fla on
    # CUDA where installed, else torch)
    linear_attention_kernels: Literal["auto", "fla", "torch"] = field(
        default="auto",
        metadata={
            "help": "Qwen3.5 gated-delta-net kernels: fla (CUDA, `uv sync --extra gpu`), "
            "torch (reference), auto (fla where installed)",
            "choices": ("auto", "fla", "torch"),
        },
    )
    reference_model: bool = False  # keep a frozen copy of the initial weights (KL penalty)
    # micro-batch token budget per GPU (packed THD rows; a row of cp x this under context
    # parallelism, each CP rank holding about this many)
    max_tokens_per_gpu: int = field(
        default=16384, metadata={"help": "micro-batch token budget per GPU", "ge": 1}
    )
    temperature: float = 1.0  # the rollout's sampling temperature, for log-probs
    grpo: GrpoLossConfig = field(default_factory=GrpoLossConfig)
    sft_loss_agg_mode: str = "token-mean"
    optim: OptimConfig = field(
        default_factory=OptimConfig,
        metadata={"help": "AdamW and the learning-rate schedule of the run's training steps"},
    )
    export_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens_per_gpu <= 0:
            raise ValueError(f"max_tokens_per_gpu must be positive, got {self.max_tokens_per_gpu}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.sp and self.tp < 2:
            raise ValueError("sp=True (sequence parallel) needs tp > 1")
        if min(self.tp, self.pp, self.ep, self.cp) < 1:
            raise ValueError(
                f"tp, pp, ep and cp must be >= 1, got {self.tp}, {self.pp}, {self.ep}, {self.cp}"
            )
        if isinstance(self.recompute, bool):
            self.recompute = "full" if self.recompute else "none"
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(
                f"recompute must be 'none', 'selective' or 'full', got {self.recompute!r}"
            )
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        if self.routing_replay and self.pp > 1 and self.recomputes_routers:
            raise NotImplementedError(
                f"routing_replay with pp={self.pp} and recompute={self.recompute!r}"
                f"{'' if self.recompute == 'full' else ' (recompute_modules with moe)'}: the "
                "1F1B schedule runs other micro-batches' forwards before a backward recomputes "
                "the routers, which megatron-core's REPLAY_BACKWARD queue would have to follow; "
                "use pp=1, or no recompute of the MoE layers"
            )
        if self.optim.lr_schedule == "cosine" and not self.optim.total_steps:
            raise ValueError("optim.lr_schedule='cosine' needs optim.total_steps")
        if not 0.0 <= self.optimizer_offload <= 1.0:
            raise ValueError(
                f"optimizer_offload must be within [0, 1], got {self.optimizer_offload}"
            )
        if self.optimizer_offload > 0 and not self.distributed_optimizer:
            raise ValueError(OFFLOAD_NEEDS_DISTRIBUTED)
        if self.optim.min_lr > self.optim.lr:  # megatron-core's scheduler asserts it
            raise ValueError("optim.min_lr must be within [0, optim.lr]")

    @property
    def recomputes_routers(self) -> bool:
        """Whether activation recompute runs the MoE routers again in backward."""
        if self.recompute == "full":
            return True
        return self.recompute == "selective" and "moe" in (self.recompute_modules or ())

    def machine_refusal(self, *, use_gpu: bool) -> str | None:
        """Why a setting cannot work here (see ``rl_runtime.protocols.TrainerConfig``)."""
        if self.linear_attention_kernels != "fla":
            return None
        if not use_gpu:
            return (
                "--linear-attention-kernels fla runs on CUDA only and this run has no GPU; "
                "use auto or torch"
            )
        if importlib.util.find_spec("fla") is None:
            return (
                "--linear-attention-kernels fla: flash-linear-attention is not installed "
                "(uv sync --extra gpu, or pip install fla-core==0.6.0); auto picks torch"
            )
        return None

    def supports(self, layout: ParallelLayout, world_size: int | None = None) -> str | None:
        """Megatron runs every split (a CLI check already refuses sequence parallel without
        TP; whether the ranks divide is the launcher's check); the optimizer on the host needs
        the distributed optimizer; routing replay cannot recompute layers over pipeline
        stages."""
        if layout.optimizer_offload > 0 and not self.distributed_optimizer:
            return OFFLOAD_NEEDS_DISTRIBUTED
        if self.routing_replay and layout.pp > 1 and layout.recompute == "full":
            return (
                "routing replay over pipeline stages cannot recompute the routers (1F1B runs "
                "other micro-batches' forwards first): --recompute none or selective"
            )
        return None

    def state_bytes(
        self, shape: ModelShape, layout: TrainLayout, *, vision_patches_per_token: float = 0.25
    ) -> StateBytes:
        """Per-GPU memory of a step on ``layout`` (trainers_megatron.memory)."""
        return memory_state_bytes(
            shape,
            layout,
            distributed_optimizer=self.distributed_optimizer,
            vision_patches_per_token=vision_patches_per_token,
            reference_model=self.reference_model,
            pieces=self.overlap_cpu_optimizer_d2h_h2d,
        )

    def describe_layout(self, layout: TrainLayout) -> list[str]:
        """The split, for a layout's one-line description."""
        p = layout.parallel
        parts = [f"megatron TP{p.tp}"] + [f"CP{p.cp}"] * (p.cp > 1)
        parts += [f"PP{p.pp}"] * (p.pp > 1)
        parts += [f"EP{p.ep}"] * (p.ep > 1) + [f"ETP{p.etp}"] * (p.etp is not None)
        parts += [f"DP{layout.dp}"]
        parts += ["SP"] * p.sp + ["distributed optimizer"] * self.distributed_optimizer
        if p.optimizer_offload > 0:
            parts.append("megatron-core HybridDeviceOptimizer")
        return parts

    def layout_flags(self, layout: TrainLayout) -> list[str]:
        """The launcher flags that select this backend and ``layout`` (recompute and tokens
        are the launcher's own)."""
        p = layout.parallel
        out = ["--backend megatron", f"--tensor-parallel {p.tp}"]
        out += ["--sequence-parallel"] * p.sp
        out += [f"--context-parallel {p.cp}"] * (p.cp > 1)
        out += [f"--pipeline-parallel {p.pp}"] * (p.pp > 1)
        out += [f"--expert-parallel {p.ep}"] * (p.ep > 1)
        out += [f"--expert-tensor-parallel {p.etp}"] * (p.etp is not None)
        return out + ["--no-distributed-optimizer"] * (not self.distributed_optimizer)

    def for_run(self, run: RunContext) -> MegatronConfig:
        """This config completed for one run: what a launcher settles (the model, the layout)
        and what the loop sets (sampling temperature, loss, schedule length, a phase's own
        schedule: ``OptimConfig.for_run``). The device is the rank's (CUDA where there is
        one)."""
        p = run.layout
        return replace(
            self,
            model=run.model,
            seed=run.seed,
            tp=p.tp,
            sp=p.sp,
            pp=p.pp,
            ep=p.ep,
            etp=p.etp,
            cp=p.cp,
            recompute=p.recompute,
            optimizer_offload=p.optimizer_offload,
            temperature=run.temperature,
            grpo=self.grpo if run.grpo is None else run.grpo,
            reference_model=run.reference_model,
            routing_replay=run.routing_replay,
            optim=self.optim.for_run(run.total_steps, run.schedule),
        )
