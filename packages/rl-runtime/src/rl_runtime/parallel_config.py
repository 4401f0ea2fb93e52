"""How the trainer is split over its GPUs, as a launcher's settings: `ParallelConfig` (tensor,
sequence, context and pipeline parallel, experts, recompute, the optimizer on the host: set,
or unset to be chosen to fit) and `check_parallel`, which refuses at parse time a layout the
trainer's backend cannot run or the trainer ranks cannot divide. Plain data without torch;
`rl_runtime.parallel` settles the layout from it (memory estimate, GPU and host memory)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rl_algos.run_context import ParallelLayout, Recompute
from rl_runtime.cluster_config import ClusterConfig, layout
from rl_runtime.config_fields import ConfigError, option
from rl_runtime.memory import OFFLOAD_FRACTIONS
from rl_runtime.protocols import TrainerConfig


@dataclass
class ParallelConfig:
    """How the trainer is split over its GPUs; unset (None) settings are chosen to fit."""

    tensor_parallel: int | None = option(
        None,
        "megatron backend: tensor-parallel size (default: 1, or the smallest that fits by the "
        "memory estimate when this, --sequence-parallel and --gradient-checkpointing are unset)",
        ge=1,
    )
    sequence_parallel: bool | None = option(
        None, "megatron backend: sequence parallel (needs TP > 1; default: on with TP > 1 chosen)"
    )
    gradient_checkpointing: bool | None = option(
        None,
        "activation checkpointing (recompute) in the trainer (default: off, or on where the "
        "memory estimate needs it)",
    )
    pipeline_parallel: int = option(
        1, "megatron backend: pipeline stages (megatron-core's 1F1B schedule)", ge=1
    )
    context_parallel: int | None = option(
        None,
        "megatron backend: context-parallel size, each packed sequence split zigzag over this "
        "many ranks (long responses; default: 1, or the smallest that fits by the memory "
        "estimate when the layout is unset)",
        ge=1,
    )
    expert_parallel: int = option(
        1,
        "megatron backend, MoE models: split the experts over this many data-parallel ranks",
        ge=1,
    )
    expert_tensor_parallel: int | None = option(
        None,
        "megatron backend, MoE models: each expert's tensor-parallel split (default: the "
        "tensor-parallel size; 1 keeps experts whole, as the slime recipe's 35B-A3B layout)",
        ge=1,
    )
    recompute: Literal["auto", "none", "selective", "full"] = option(
        "auto",
        "activation recomputation: full (whole decoder layers), selective (megatron backend: "
        "core attention) or none; auto: full with --gradient-checkpointing, none with "
        "--no-gradient-checkpointing, else as the memory estimate needs",
    )
    gpu_memory_gib: float | None = option(
        None,
        "memory per GPU for the layout check (default: what the GPU reports, read without "
        "allocating; 0: no check)",
        ge=0,
    )
    optimizer_cpu_offload: bool | None = option(
        None,
        "keep the optimizer state (float32 masters, AdamW moments) in host memory and step it "
        "there (megatron: megatron-core's HybridDeviceOptimizer; fsdp: one GPU or "
        "--fsdp-replicate); default: only where the memory estimate finds no layout that "
        "holds it on the GPU",
    )
    optimizer_offload_fraction: float | None = option(
        None,
        "the part of the optimizer state on the host under --optimizer-cpu-offload (default: "
        "the smallest tenth that fits the GPU, or 1 without an estimate)",
        gt=0,
        le=1,
    )
    host_memory_gib: float | None = option(
        None,
        "host memory of a node for the layout check (default: the machine's; 0: no check)",
        ge=0,
    )

    def check(self) -> None:
        if self.sequence_parallel and (self.tensor_parallel or 1) < 2:
            raise ConfigError("--sequence-parallel needs --tensor-parallel of 2 or more")
        if self.optimizer_cpu_offload is False and self.optimizer_offload_fraction is not None:
            raise ConfigError(
                "--optimizer-offload-fraction contradicts --no-optimizer-cpu-offload; give one"
            )
        gc, mode = self.gradient_checkpointing, self.recompute
        if mode != "auto" and gc is not None and gc != (mode == "full"):
            raise ConfigError(
                f"--recompute {mode} contradicts --{'' if gc else 'no-'}gradient-checkpointing "
                "(which means --recompute full / none); give one of them"
            )

    @property
    def unset(self) -> bool:
        """No layout setting given: the first layout that fits is chosen."""
        given = (
            self.tensor_parallel,
            self.sequence_parallel,
            self.gradient_checkpointing,
            self.context_parallel,
        )
        return given == (None, None, None, None) and self.recompute == "auto"

    @property
    def recompute_mode(self) -> Recompute:
        """The recomputation asked for: ``--recompute``, else ``--gradient-checkpointing``."""
        if self.recompute != "auto":
            return self.recompute
        return "full" if self.gradient_checkpointing else "none"

    @property
    def tp_cp_size(self) -> int:
        """Ranks of one replica's pipeline stage (TP fastest, then CP: Megatron's order), the
        ranks that share a data shard: `TrainGroup`'s ``tp_size``."""
        return (self.tensor_parallel or 1) * (self.context_parallel or 1)

    def trainer_layout(self) -> ParallelLayout:
        """The settled layout as `TrainerConfig.for_run` (in its `RunContext`) and
        `TrainerConfig.supports` take it."""
        return ParallelLayout(
            tp=self.tensor_parallel or 1,
            sp=bool(self.sequence_parallel),
            cp=self.context_parallel or 1,
            pp=self.pipeline_parallel,
            ep=self.expert_parallel,
            etp=self.expert_tensor_parallel,
            recompute=self.recompute_mode,
            optimizer_offload=self.offload_fraction,
        )

    @property
    def offload_fraction(self) -> float:
        """The part of the optimizer state on the host: 0 unless offloading is on (unset: not
        chosen yet), then the fraction given, else all of it."""
        if not (self.optimizer_cpu_offload or self.optimizer_offload_fraction):
            return 0.0
        return self.optimizer_offload_fraction or 1.0

    def with_optimizer_offload(self, fraction: float) -> ParallelConfig:
        """This layout with ``fraction`` of the optimizer state on the host (0: none)."""
        return dataclasses.replace(
            self,
            optimizer_cpu_offload=fraction > 0,
            optimizer_offload_fraction=fraction or None,
        )

    @property
    def offload_options(self) -> tuple[float, ...]:
        """The fractions a layout chooser may try after ``offload_fraction``: every tenth when
        offloading is unset or on without a fraction, none when it is off or given."""
        if self.optimizer_cpu_offload is False or self.optimizer_offload_fraction is not None:
            return ()
        return OFFLOAD_FRACTIONS


def check_parallel(
    trainer: TrainerConfig,
    parallel: ParallelConfig,
    cluster: ClusterConfig | None = None,
    *,
    with_engines: bool = True,
) -> None:
    """A layout the trainer's backend cannot run (`TrainerConfig.supports`) and (given the
    cluster) a split the trainer ranks cannot make, checked before anything starts (the
    backend would otherwise fail inside every rank)."""
    ranks = None if cluster is None else layout(cluster, with_engines=with_engines).num_trainers
    refusal = trainer.supports(parallel.trainer_layout(), ranks)
    if refusal:
        raise ConfigError(refusal)
    if cluster is not None and ranks is not None:
        _check_split(parallel, cluster, ranks, with_engines=with_engines)


def _check_split(
    parallel: ParallelConfig, cluster: ClusterConfig, ranks: int, *, with_engines: bool
) -> None:
    if not cluster.use_gpu:
        where = f"a CPU run has --cpu-trainers {ranks} trainer rank(s)"
    elif cluster.colocate or not with_engines:
        where = f"--num-gpus {cluster.num_gpus} gives {ranks} trainer rank(s)"
    else:
        where = f"--num-gpus {cluster.num_gpus} --no-colocate leaves {ranks} trainer rank(s)"
    tp, pp, ep = parallel.tensor_parallel or 1, parallel.pipeline_parallel, parallel.expert_parallel
    etp = parallel.expert_tensor_parallel or tp
    cp = parallel.context_parallel or 1
    splits = (
        (
            "--tensor-parallel x --context-parallel x --pipeline-parallel",
            f"{tp} x {cp} x {pp}",
            tp * cp * pp,
        ),
        (
            "--expert-parallel x expert tensor parallel x --pipeline-parallel",
            f"{ep} x {etp} x {pp}",
            ep * etp * pp,
        ),
    )
    for flags, sizes, size in splits:
        if ranks % size:
            raise ConfigError(
                f"the layout needs trainer ranks in multiples of {flags} = {sizes} = "
                f"{size}, but {where}; give a layout that divides them, or more GPUs"
            )
