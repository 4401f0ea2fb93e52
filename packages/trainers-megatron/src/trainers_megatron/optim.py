"""megatron-core's data parallelism, optimizer and learning-rate schedule for the Megatron actor.

The model is wrapped in megatron-core's ``DistributedDataParallel`` (contiguous gradient
buffers; float32 gradients, reduced in float32) and stepped by the optimizer of
``get_megatron_optimizer``: with ``distributed_optimizer`` the ``DistributedOptimizer``
(float32 master weights and AdamW moments sharded over the data-parallel group, gradients
reduce-scattered, the updated weights all-gathered), else its float32 / mixed-precision
optimizer on every rank (gradients all-reduced). Experts get their own optimizer over the
expert-data-parallel group (megatron-core chains the two).

The step's calls on it are :class:`OptimizerStep`'s: the gradient norm and clipping without
host reads, and (:mod:`trainers_megatron.flat_masters`) the distributed optimizer's
per-parameter bookkeeping done on whole bucket shards. The learning rate follows
megatron-core's ``OptimizerParamScheduler`` (:func:`build_scheduler`), the FSDP actor's schedule
step for step (``tests/test_lr_schedules.py``).

``offload`` > 0 (``--optimizer-cpu-offload``) is megatron-core's own optimizer CPU offload:
``optimizer_cpu_offload`` with that ``optimizer_offload_fraction`` under the precision-aware
distributed optimizer (``use_precision_aware_optimizer``, which megatron-core's training
arguments require with it: the distributed optimizer then keeps no float32 masters of its own
on the GPU). Its ``HybridDeviceOptimizer`` keeps the first fraction of this rank's shard as
float32 host copies (one torch AdamW each) and owns them and their moments (its state dicts,
checkpoints and resume); the rest steps on the GPU. Clipping reaches every AdamW as
``grad_scale``.

With ``overlap_offload`` (``overlap_cpu_optimizer_d2h_h2d``, the default) the host half steps
through :class:`trainer_core.host_adamw.HostAdamW`, the FSDP backend's host step: in pieces,
the next gradients crossing PCIe into pinned buffers and the last weights crossing back while
the CPU steps this piece. megatron-core 0.16.1's own step (``hybrid_optimizer.py``) copies every
float32 gradient into pageable host memory before the first host AdamW starts (a copy into
pageable memory returns only when done), then after each AdamW copies its float32 masters
from pageable memory into the bf16 weights, one tensor after another; it also keeps a float32
host copy of every offloaded gradient (4 bytes a parameter) that the pieces replace.
Without ``overlap_offload`` megatron-core's own step runs.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from torch import Tensor

from rl_algos.optimizer import OptimConfig
from trainer_core import host_threads
from trainer_core.host_adamw import HostAdamW
from trainers_megatron.flat_masters import FlatMasters
from trainers_megatron.host_step import (
    fresh_adam_state,
    host_adamw_for,
    optimizer_grad,
    step_in_pieces,
)


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool) -> DistributedDataParallel:
    """megatron-core's DDP around ``model``: float32 gradient buffers and reduction; one bucket
    reduced after the last micro-batch (no overlap: the step reads the gradients right after).
    The loss is already scaled for a sum over ranks (``calculate_per_token_loss``)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def build_optimizer(
    model: DistributedDataParallel,
    *,
    lr: float,
    min_lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    distributed_optimizer: bool,
    offload: float = 0.0,
    overlap_offload: bool = True,
) -> MegatronOptimizer:
    """AdamW through ``get_megatron_optimizer``; weight decay on matrices only (megatron-core's
    default: none on 1-D tensors and biases). Clipping is :class:`OptimizerStep`'s (``clip_grad=0``).
    ``offload``: the fraction of the optimizer stepped on the host (see the module docstring)."""
    config = model.config
    offloading: dict[str, Any] = {}
    if offload > 0:
        cuda = torch.cuda.is_available()
        offloading = dict(
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=offload,
            overlap_cpu_optimizer_d2h_h2d=overlap_offload,
            store_param_remainders=False,  # what its check sets without Transformer Engine
            # pageable, where megatron-core's own step makes host gradient copies (without
            # overlap_offload, and a resume's first step on random gradients): it pins each
            # through torch's caching host allocator, which rounds it up to a power of two
            pin_cpu_grads=False,
            pin_cpu_params=cuda,
        )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=0.0,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=distributed_optimizer,
        **offloading,
    )
    if offload > 0:
        _precision_aware(opt_config)
    optimizer = get_megatron_optimizer(opt_config, [model])
    if offload > 0:
        # megatron-core 0.16.1 builds a first HybridDeviceOptimizer over the whole model's
        # parameters, then the DistributedOptimizer replaces it by one over its shards: the
        # first one, with float32 copies of the offloaded part on the host (23 GiB for the 8B
        # at 70 %) and of the rest on the GPU, is left in a reference cycle (its sub-optimizers'
        # step hooks point back at it). A trainer process collects only between steps
        # (rl_runtime.gc_policy): collect it now, not after the first step.
        gc.collect()
    fuse_torch_adam(optimizer)
    for opt in optimizers(optimizer):
        if (hybrid := hybrid_optimizer(opt)) is not None:
            exact_pinned_masters(hybrid)
            # a state-dict load makes its host masters anew (its own post-load hook runs
            # _init_sub_optimizers), pinned the rounding way again
            hybrid.register_load_state_dict_post_hook(exact_pinned_masters)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the first copies of the weights and masters, freed above
    init_adam_state(optimizer)
    return optimizer


def adam_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam / AdamW optimizers that step ``optimizer``'s parameters: each chained
    optimizer's, or a HybridDeviceOptimizer's host and device ones."""
    out: list[torch.optim.Optimizer] = []
    for opt in optimizers(optimizer):
        hybrid = hybrid_optimizer(opt)
        for inner in hybrid.sub_optimizers if hybrid is not None else [opt.optimizer]:
            if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                out.append(inner)
    return out


@torch.no_grad()
def init_adam_state(optimizer: MegatronOptimizer) -> None:
    """Make the AdamW state of every parameter now (zero moments, a zero step count: what
    torch's AdamW makes at its first step), instead of at the first step.

    Made at the first step, the moments the device steps (8 bytes per parameter of its part)
    are the first large tensors allocated after a backward has freed its activations and
    logits: the caching allocator carves them out of those freed blocks, and a segment that
    holds any live block stays reserved through ``torch.cuda.empty_cache`` (the actor's
    ``release_cache``), out of a colocated engine's reach however little of it is used (a
    suspect for the 11 GiB the Qwen3.5 cut's trainer held past its plan on an H100,
    2026-12-06). Made here, before any forward, they lie in segments of their own; every
    storage the released actor keeps then exists from its build on (tests/test_resident.py).
    The step is unchanged: torch's AdamW makes a parameter's state only where it has none."""
    for inner in adam_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(fresh_adam_state(p, group))


def build_scheduler(optimizer: Any, cfg: OptimConfig) -> Any:
    """megatron-core's scheduler over the optimizer's groups: linear warmup from 0, then
    constant or cosine down to ``min_lr`` at ``total_steps``; weight decay constant
    (times each group's ``wd_mult``: 0 for 1-D tensors and biases)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = cfg.warmup_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(cfg.total_steps or 0, warmup + 1),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def exact_pinned_masters(hybrid: Any) -> int:
    """Move a HybridDeviceOptimizer's pinned host masters into page-locked memory of their own
    size, then empty torch's host cache; returns the bytes moved.

    megatron-core 0.16.1 copies each offloaded parameter to the host with
    ``Tensor.pin_memory()`` (whatever ``pin_cpu_params`` says), through torch's caching host
    allocator, which rounds every block up to a power of two and keeps freed ones locked: a
    151 MB float32 matrix locks 256 MiB. Under the precision-aware optimizer those pinned copies
    are the bf16 parameters, widened at once into pageable float32 masters; the pinned copies
    are dropped, but their rounded blocks stay in the cache (about 15 GiB for the 8B at 70 %),
    so the cache is emptied whether or not a master moved. On a host that the 8B model's
    optimizer nearly fills, that is the difference between fitting and Ray's memory monitor
    killing the trainer (it killed the FSDP trainer for the same rounding, H200, 2026-12-04).
    Each master keeps its tensor object (``.data`` is swapped), so the optimizer's maps and
    groups stay valid; the freed blocks go back to the system."""
    from trainer_core.offload import PIN_REGISTER_BYTES, pinned_empty

    moved = 0
    masters = list(getattr(hybrid, "cpu_copys_map_gpu_param", {}))
    # registered while these tensors live: keep those still under a master (a load's new
    # masters leave the earlier ones to be freed)
    live = {m.data_ptr() for m in masters}
    kept = [t for t in hybrid.__dict__.get("_exact_pinned", []) if t.data_ptr() in live]
    hybrid.__dict__["_exact_pinned"] = kept
    done = {t.data_ptr() for t in kept}
    for cpu_param in masters:
        nbytes = cpu_param.numel() * cpu_param.element_size()
        if (
            nbytes >= PIN_REGISTER_BYTES
            and cpu_param.is_pinned()
            and cpu_param.data_ptr() not in done
        ):
            host = pinned_empty(cpu_param.shape, cpu_param.dtype).copy_(cpu_param.data)
            cpu_param.data = host
            kept.append(host)
            moved += nbytes
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None and torch.cuda.is_available():
        empty_host_cache()
    return moved


def _precision_aware(config: OptimizerConfig) -> None:
    """Turn on ``use_precision_aware_optimizer`` after the config's own check.

    megatron-core 0.16.1's ``OptimizerConfig.__post_init__`` compares the Transformer Engine
    version with ``is_te_min_version("2.1.0")`` before it returns for ``optimizer_cpu_offload``,
    and without Transformer Engine that comparison raises (``None >= Version``). What the check
    would leave for a CPU-offloaded optimizer without Transformer Engine is set here:
    ``store_param_remainders=False`` (given at construction) and the derived flag."""
    if not (config.optimizer == "adam" and config.use_distributed_optimizer):
        raise ValueError("the precision-aware optimizer needs AdamW and the distributed optimizer")
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True


def fuse_torch_adam(optimizer: MegatronOptimizer) -> None:
    """Step torch's AdamW in its fused kernel.

    Without Transformer Engine or Apex, megatron-core 0.16.1 falls back to
    ``torch.optim.AdamW`` with torch's default, the ``foreach`` implementation: about a dozen
    passes over the float32 masters and moments per step, where the fused kernel makes one.
    torch fuses float32 on CUDA and on CPU, so the CPU tests run the arithmetic the GPU runs.
    Step counters a checkpoint left on the host move to the parameters' device, where the
    fused kernel keeps them.
    """
    for opt in optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue  # Transformer Engine's or Apex's FusedAdam, already one kernel
        for group in inner.param_groups:
            params = group["params"]
            fusable = all(
                p.device.type in ("cuda", "cpu") and p.dtype == torch.float32 for p in params
            )
            if not params or not fusable:
                continue
            group["fused"], group["foreach"] = True, False
            for p in params:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, Tensor) and step.device != p.device:
                    inner.state[p]["step"] = step.to(p.device, torch.float32)


def optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers a (possibly chained) megatron-core optimizer steps."""
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


class OptimizerStep:
    """The step's calls on a megatron-core optimizer: hand the gradients to the masters, their
    norm, the clipped AdamW step and the weights back, zeroing. Each (chained) optimizer goes
    through :class:`~trainers_megatron.flat_masters.FlatMasters` where its layout allows and
    ``flat`` is set, else through megatron-core's own per-parameter path.

    Two pieces are ours either way, on megatron-core's selections: the gradient norm (the
    squares of ``get_main_grads_for_grad_norm()`` summed over each optimizer's
    gradient-statistics group, kept on the device: megatron-core's ``get_grad_norm_fp32`` reads
    the norm to the host, and without Apex or Transformer Engine its local multi-tensor L2 norm
    reads every tensor's norm), and clipping by that norm without a host read.
    """

    def __init__(
        self,
        optimizer: MegatronOptimizer,
        *,
        flat: bool = True,
        host_threads: int | None = None,
        pieces: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.parts = [(opt, FlatMasters.of(opt) if flat else None) for opt in optimizers(optimizer)]
        self.host_threads = host_threads
        self.pieces = pieces  # the host half through HostAdamW (see the module docstring)
        self.host_adamw: HostAdamW | None = None  # the pieces' step, its buffers kept

    @property
    def flat(self) -> bool:
        """Whether every optimizer runs through flat masters."""
        return all(f is not None for _, f in self.parts)

    def prepare_grads(self) -> Tensor:
        """The reduced gradients handed to the masters; their global L2 norm (float32, on the
        device; no host read). Under the distributed optimizer each rank norms its shard and
        the squares are summed over every rank of the optimizer's instance."""
        total = None
        for opt, flat in self.parts:
            if flat is None:
                opt.prepare_grads()
                grads = [g.float() for g in opt.get_main_grads_for_grad_norm()]
            else:
                flat.attach_grads()
                grads = flat.grads_for_norm
            if grads:  # one fused pass over the tensors
                square = torch.stack(torch._foreach_norm(grads)).square().sum()
            else:
                square = torch.zeros((), dtype=torch.float32, device=_device())
            dist.all_reduce(square, group=opt.get_grad_stats_parallel_group())
            total = square if total is None else total + square
        assert total is not None
        return total.sqrt()

    def step(self, norm: float, max_norm: float) -> None:
        """Clip to ``max_norm`` (0: no clipping) by the global ``norm``, as
        ``clip_grad_by_total_norm_fp32`` does without its host-side checks; AdamW on the float32
        masters; the weights from them (all-gathered under the distributed optimizer)."""
        coeff = max_norm / (norm + 1e-6) if max_norm > 0 else 1.0
        clip = coeff if coeff < 1.0 else None
        for opt, flat in self.parts:
            if flat is not None:
                flat.step(clip)
                continue
            hybrid = hybrid_optimizer(opt)
            if hybrid is not None:
                self._hybrid_step(opt, hybrid, clip)
                continue
            if clip is not None:
                grads = [
                    optimizer_grad(p) for p in opt.get_parameters() if optimizer_grad(p) is not None
                ]
                if grads:
                    torch._foreach_mul_(grads, clip)
            opt.step_with_ready_grads()

    def _hybrid_step(self, opt: MegatronOptimizer, hybrid: Any, clip: float | None) -> None:
        """megatron-core's step of a HybridDeviceOptimizer: clipping as each of its fused
        AdamWs' ``grad_scale`` (no pass over the gradients), the host half through
        :class:`HostAdamW` where ``pieces`` is set (else megatron-core's own), on
        ``host_threads`` threads; returns once the weights are back on the device."""
        subs = hybrid.sub_optimizers
        fused = all(g.get("fused") for sub in subs for g in sub.param_groups)
        if clip is not None and not fused:
            grads = [
                optimizer_grad(p) for p in opt.get_parameters() if optimizer_grad(p) is not None
            ]
            torch._foreach_mul_(grads, clip)
            clip = None
        if clip is not None:
            for sub in subs:
                device = sub.param_groups[0]["params"][0].device
                sub.grad_scale = torch.full((), 1.0 / clip, device=device)
        if self.pieces and hybrid.cpu_optimizers:
            # the distributed optimizer's step_with_ready_grads calls hybrid.step(), then
            # gathers the weights: this step only, in its place
            if self.host_adamw is None:
                self.host_adamw = host_adamw_for(hybrid, self.host_threads)
            divide = None if clip is None else 1.0 / clip
            hybrid.step = functools.partial(step_in_pieces, hybrid, self.host_adamw, divide)
        try:
            with host_threads(self.host_threads):
                opt.step_with_ready_grads()
        finally:
            hybrid.__dict__.pop("step", None)
            for sub in subs:
                sub.grad_scale = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the last weights' copies back belong to the step

    def zero_grad(self, model: DistributedDataParallel) -> None:
        """Zero the gradient buffers (the flat masters' gradients are views of them); the
        per-parameter path also drops its masters' gradients."""
        model.zero_grad_buffer()
        for opt, flat in self.parts:
            if flat is None:
                opt.zero_grad()


def hybrid_optimizer(opt: MegatronOptimizer) -> Any:
    """The HybridDeviceOptimizer ``opt`` steps (``optimizer_cpu_offload``), or None."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, HybridDeviceOptimizer) else None


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
