"""The training layout, settled in the driver before Ray or any model starts: from the
settings of `rl_runtime.parallel_config.ParallelConfig` (tensor / sequence parallel and
recompute: set, or unset to be chosen), the first layout that fits the GPUs by the memory
estimate of `rl_runtime.memory` (chosen when unset, refused with the numbers when set and too
big), within the host memory a node shares out (`node_host_plan`). Nothing here touches GPU
memory; the model's shape comes from the app (`vlm_models.model_shape`), as plain numbers."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rl_algos.run_context import TrainLayout
from rl_runtime.cluster_config import ClusterConfig, layout
from rl_runtime.colocation import ENGINE_IDLE_BYTES
from rl_runtime.memory import (
    HOST_CAP,
    HOST_RESERVE_BYTES,
    PROCESS_HOST_BYTES,
    MemoryEstimate,
    ModelShape,
    check_layout,
    choose_layout,
    estimate_memory,
)
from rl_runtime.parallel_config import ParallelConfig
from rl_runtime.preflight import PreflightError, check_gpus, count_gpus
from rl_runtime.protocols import TrainerConfig
from rl_runtime.run import RunConfig

GiB = 1 << 30

log = logging.getLogger(__name__)

M = TypeVar("M")


def gpu_memory_bytes(parallel: ParallelConfig) -> float | None:
    """Memory of the smallest visible GPU: ``--gpu-memory-gib``, else its total memory from
    ``torch.cuda.get_device_properties``, which allocates nothing (``mem_get_info`` would need
    a CUDA context, hundreds of MiB, in the driver); None: no check."""
    if parallel.gpu_memory_gib is not None:
        return parallel.gpu_memory_gib * GiB if parallel.gpu_memory_gib > 0 else None
    if count_gpus() == 0:  # no GPU: nothing to read, and no torch to import for it
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return min(
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    )


def host_memory_bytes(parallel: ParallelConfig) -> float | None:
    """A node's memory: ``--host-memory-gib``, else the machine's physical memory; None: no
    check (0, or a platform that does not say)."""
    if parallel.host_memory_gib is not None:
        return parallel.host_memory_gib * GiB if parallel.host_memory_gib > 0 else None
    try:
        import os

        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def host_budget(
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    shape: ModelShape,
    *,
    with_engines: bool,
    engines_park_weights: bool = True,
) -> float | None:
    """Host memory one trainer rank's state may take (the backend's ``StateBytes.host``) so that
    the node's peak stays under :data:`~rl_runtime.memory.HOST_CAP` of its memory
    (:func:`node_host_plan`); None where the node's memory is not known."""
    plan = node_host_plan(
        parallel,
        cluster,
        shape,
        with_engines=with_engines,
        engines_park_weights=engines_park_weights,
    )
    return None if plan is None else plan.per_rank


@dataclass(frozen=True)
class NodeHostPlan:
    """A node's host memory as the plan shares it out (bytes): under ``cap`` (:data:`HOST_CAP`
    of its ``total``) go the launcher and Ray (``reserve``), the runtime of each of its
    ``trainers`` and ``engines`` processes (``processes``), the weights colocated engines park
    there (``parked``), and ``per_rank`` for each trainer rank's state."""

    total: float
    cap: float
    reserve: float
    processes: float
    parked: float
    trainers: int
    engines: int

    @property
    def per_rank(self) -> float:
        left = self.cap - self.reserve - self.processes - self.parked
        return max(0.0, left / max(1, self.trainers))


def node_host_plan(
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    shape: ModelShape,
    *,
    with_engines: bool,
    engines_park_weights: bool = True,
) -> NodeHostPlan | None:
    """How one node's memory (``--host-memory-gib``, else the machine's) is shared out: the
    trainer ranks of a node are as many as its visible GPUs (or all); its engines, colocated,
    one per trainer GPU, else the rollout GPUs beside them; the weights they park on the host
    (bf16, one copy per engine) only where ``engines_park_weights`` (else a release drops them
    and the push refills them). None where the node's memory is not known."""
    total = host_memory_bytes(parallel)
    if total is None:
        return None
    lay = layout(cluster, with_engines=with_engines)
    local = count_gpus()
    trainers = min(lay.num_trainers, local or lay.num_trainers)
    if not with_engines:
        engines = 0
    elif lay.colocate:
        engines = trainers
    else:
        engines = min(lay.num_engines, max(0, (local or cluster.num_gpus) - trainers))
    park = with_engines and lay.colocate and engines_park_weights
    params = shape.language_params + shape.vision_params
    return NodeHostPlan(
        total=total,
        cap=HOST_CAP * total,
        reserve=HOST_RESERVE_BYTES,
        processes=(trainers + engines) * PROCESS_HOST_BYTES,
        parked=engines * 2 * params if park else 0.0,
        trainers=trainers,
        engines=engines,
    )


def train_gpu_bytes(
    parallel: ParallelConfig, cluster: ClusterConfig, *, with_engines: bool
) -> float | None:
    """What a trainer rank's step may take of its GPU: all of it, less what a colocated engine
    keeps there while released (``ENGINE_IDLE_BYTES``); None: not known."""
    gpu = gpu_memory_bytes(parallel)
    if gpu is None or not (with_engines and layout(cluster, with_engines=True).colocate):
        return gpu
    return gpu - ENGINE_IDLE_BYTES


def _requested(
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    trainer: TrainerConfig,
    with_engines: bool,
    longest_sample: int = 0,
) -> TrainLayout:
    return TrainLayout(
        world_size=layout(cluster, with_engines=with_engines).num_trainers,
        max_tokens_per_gpu=trainer.max_tokens_per_gpu,
        parallel=parallel.trainer_layout(),
        longest_sample=longest_sample,
    )


def plan_layout(
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    *,
    trainer: TrainerConfig,
    shape: Mapping[str, int] | None,
    others: Sequence[TrainerConfig] = (),
    model_name: str = "the model",
    with_engines: bool = True,
    longest_sample: int = 0,
    engines_park_weights: bool = True,
) -> tuple[ParallelConfig, MemoryEstimate | None]:
    """`parallel` with the layout settled, and its memory estimate (None: a CPU run, or the
    model's shape or the GPU's memory is not known). Unset settings get the first layout that
    fits; set ones are kept, and a layout that cannot fit stops the run (`PreflightError`)
    with the numbers and a suggestion, on this backend or one of ``others`` (the other
    backends' configs the launcher offers). ``longest_sample``: tokens of the longest sequence
    (prompt and response), which one micro-batch holds whole (0: not known)."""
    estimate = None
    if cluster.num_gpus > 0:
        gpu = train_gpu_bytes(parallel, cluster, with_engines=with_engines)
        if shape is not None and gpu is not None:
            model = ModelShape(**shape)
            host = host_budget(
                parallel,
                cluster,
                model,
                with_engines=with_engines,
                engines_park_weights=engines_park_weights,
            )
            requested = _requested(parallel, cluster, trainer, with_engines, longest_sample)
            requested, _ = choose_layout(
                model,
                trainer,
                requested,
                gpu,
                vary=parallel.unset,
                offloads=parallel.offload_options,
                host_bytes=host,
            )
            estimate = check_layout(
                model,
                trainer,
                requested,
                gpu,
                others=others,
                model=model_name,
                host_bytes=host,
                gpu_note=_engine_kept(parallel, gpu),
            )
            log.info(
                "layout: %s; about %.1f GiB per GPU of %.1f%s (%s)",
                estimate.description,
                estimate.total / GiB,
                gpu / GiB,
                _engine_kept(parallel, gpu),
                estimate.breakdown(),
            )
            chosen = requested.parallel
            if parallel.unset:
                parallel = dataclasses.replace(
                    parallel,
                    tensor_parallel=chosen.tp,
                    sequence_parallel=chosen.sp,
                    gradient_checkpointing=requested.recomputes,
                    context_parallel=chosen.cp,
                )
            if chosen.optimizer_offload > 0:
                log.info(
                    "optimizer: %.0f%% of its state on the host, about %.1f GiB per trainer "
                    "rank of %s",
                    100 * chosen.optimizer_offload,
                    estimate.host / GiB,
                    "an unknown budget" if host is None else f"{host / GiB:.1f} GiB",
                )
            parallel = parallel.with_optimizer_offload(chosen.optimizer_offload)
    settled = dataclasses.replace(
        parallel,
        tensor_parallel=parallel.tensor_parallel or 1,
        context_parallel=parallel.context_parallel or 1,
        sequence_parallel=bool(parallel.sequence_parallel),
        gradient_checkpointing=parallel.recompute_mode == "full",
    )
    return settled, estimate


def state_estimate(
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    *,
    trainer: TrainerConfig,
    shape: Mapping[str, int] | None,
) -> MemoryEstimate | None:
    """The memory estimate of a settled layout (``plan_layout``'s result), without checking or
    logging it; None on CPUs or when the shape is not known."""
    if cluster.num_gpus <= 0 or shape is None:
        return None
    requested = _requested(parallel, cluster, trainer, with_engines=True)
    return estimate_memory(ModelShape(**shape), trainer, requested)


def layout_report(
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    *,
    backend: str,
    trainer: TrainerConfig,
    shape: Mapping[str, int] | None,
    others: Sequence[TrainerConfig] = (),
    model_name: str = "the model",
    with_engines: bool = True,
    longest_sample: int = 0,
    engines_park_weights: bool = True,
) -> dict[str, Any]:
    """For `--print-config`: the layout the run would use and its memory estimate, or why there
    is none; a layout that cannot fit is reported, not raised. ``backend``: the trainer's name,
    for the CPU run's line."""
    if cluster.num_gpus <= 0:
        return {"description": f"CPU run, {backend}, {cluster.cpu_trainers} trainer rank(s)"}
    gpu = train_gpu_bytes(parallel, cluster, with_engines=with_engines)
    if shape is None or gpu is None:
        why = _not_estimated(parallel, gpu is not None, model_name, shape is not None)
        return {"description": f"not estimated: {why}"}
    park = engines_park_weights
    host = host_budget(
        parallel, cluster, ModelShape(**shape), with_engines=with_engines, engines_park_weights=park
    )
    try:
        settled, estimate = plan_layout(
            parallel,
            cluster,
            trainer=trainer,
            shape=shape,
            others=others,
            model_name=model_name,
            with_engines=with_engines,
            longest_sample=longest_sample,
            engines_park_weights=park,
        )
    except PreflightError as err:
        requested = _requested(parallel, cluster, trainer, with_engines, longest_sample)
        report = estimate_memory(ModelShape(**shape), trainer, requested).to_dict(gpu, host)
        return {**report, "refused": err.message}
    assert estimate is not None
    out = estimate.to_dict(gpu, host)
    whole = gpu_memory_bytes(parallel)
    if whole is not None and whole != gpu:  # fits within the GPU less the released engine
        out["gpu_gib"] = round(whole / GiB, 1)
        out["engine_idle_gib"] = round((whole - gpu) / GiB, 1)
    if settled.optimizer_cpu_offload and parallel.optimizer_cpu_offload is None:
        out["optimizer_cpu_offload"] = (
            f"chosen: no layout holds the optimizer state on the GPU; "
            f"{settled.offload_fraction:.0%} of it on the host"
        )
    return out


def _engine_kept(parallel: ParallelConfig, train_bytes: float) -> str:
    """For the layout's line: the GPU's whole memory where the step has less of it."""
    whole = gpu_memory_bytes(parallel)
    if whole is None or whole == train_bytes:
        return ""
    return f" ({whole / GiB:.1f} less {(whole - train_bytes) / GiB:.1f} a released engine keeps)"


def _not_estimated(
    parallel: ParallelConfig, gpu_known: bool, model_name: str, shape_known: bool
) -> str:
    """Why `layout_report` has no estimate, with the flag that gives one."""
    why = []
    if not gpu_known:
        why.append(
            "--gpu-memory-gib 0 turns the estimate off"
            if parallel.gpu_memory_gib == 0
            else "no GPU is visible to read its memory from: give it with --gpu-memory-gib N "
            "(an H200: 140.4)"
        )
    if not shape_known:
        why.append(
            f"the config of {model_name} is not known without downloading it: give a local "
            "model folder with --model-name (or a shape preset)"
        )
    return "; ".join(why)


def settle(
    model: M,
    parallel: ParallelConfig,
    cluster: ClusterConfig,
    run: RunConfig,
    *,
    trainer: TrainerConfig,
    shape_of: Callable[..., Mapping[str, int] | None],
    resolve: Callable[..., M],
    others: Sequence[TrainerConfig] = (),
    with_engines: bool = True,
    longest_sample: int = 0,
    engines_park_weights: bool = True,
) -> tuple[M, ParallelConfig]:
    """Everything about the model a launcher settles before Ray, in order: the layout where the
    model's shape is known without a download (so a layout that cannot fit stops before it),
    the GPU count, the model's local files, then the layout of a model known only once
    downloaded. `shape_of(model, load=)` and `resolve(model, load=)` are the model package's
    (`vlm_models.shape_of`, `vlm_models.resolve_model`); `model` names itself in messages by
    its `model_name`; ``others``: the other backends' configs, for a refusal's suggestions."""

    def plan(m: M) -> tuple[ParallelConfig, MemoryEstimate | None]:
        return plan_layout(
            parallel,
            cluster,
            trainer=trainer,
            shape=shape_of(m, load=run.load),
            others=others,
            model_name=str(getattr(m, "model_name", m)),
            with_engines=with_engines,
            longest_sample=longest_sample,
            engines_park_weights=engines_park_weights,
        )

    planned, estimate = plan(model)
    check_gpus(cluster.num_gpus, preset=run.preset)
    resolved = resolve(model, load=run.load)
    if estimate is None:
        planned, _ = plan(resolved)
    return resolved, planned
