"""The Megatron-Core actor: log-probs, GRPO / SFT optimizer steps, weight export, checkpoints.

It implements the trainer protocol (``rl_runtime.protocols.TrainActor``) on
:mod:`vlm_models.megatron` (native Megatron decoder + HF vision tower). One actor runs in each
rank's process; every method is collective. Ranks of one model replica (its tensor- and
pipeline-parallel ranks) work on the same samples (the replica's first rank's batch is
broadcast to the others); data-parallel replicas each take their own part of the global batch.

Samples are packed into THD micro-batches of at most ``max_tokens_per_gpu`` tokens and run
through megatron-core's forward-backward schedule (:mod:`trainers_megatron.schedule`: 1F1B
across pipeline stages). The model is wrapped in megatron-core's DDP (float32 gradient buffers
and reduction) and stepped by megatron-core's optimizer, by default the distributed optimizer
(float32 masters and AdamW moments sharded over the data-parallel group;
:mod:`trainers_megatron.optim`). MoE experts can be split over ``ep`` data-parallel ranks.
Log-probs use Megatron's vocab-parallel cross entropy, so full-vocabulary logits are never
gathered; ``reference_model=True`` keeps a frozen copy of the initial weights for KL.

The actor holds the state and the order of things; its parts live beside it, under the names
trainers_fsdp uses for the same parts: what the model is built with and starts from
(:mod:`trainers_megatron.model`), the stage forward the schedule runs
(:mod:`trainers_megatron.forward`), the micro-batch plan (:mod:`trainers_megatron.microbatch`),
DDP, the optimizer and its schedule (:mod:`trainers_megatron.optim`), checkpoints and the HF
export (:mod:`trainers_megatron.checkpoint`) and the state moved around a colocated rollout
(:mod:`trainers_megatron.offload`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from torch import Tensor
from torch.profiler import record_function

from rl_algos import (
    EntropyMode,
    MicroBatches,
    MicroBatchLoss,
    TrainBatch,
    TrainLoss,
    resolve_loss,
)
from rl_algos import train_step as core
from trainer_core import MicroBatch, PinnedStaging, build_micro_batch, replays_routes
from trainer_core.compile_log import log_compiles
from trainer_core.offload import timed_copies, transfer_metrics
from trainer_core.startup import StartupLog
from trainers_megatron.checkpoint import export_hf, load_checkpoint, save_checkpoint
from trainers_megatron.config import MegatronConfig
from trainers_megatron.context_parallel import split_row
from trainers_megatron.forward import clear_replayed_routes, drop_dispatch_state, stage_forward
from trainers_megatron.microbatch import group_batch, plan_micro_batches
from trainers_megatron.model import load_initial_weights, model_settings
from trainers_megatron.offload import StorageOffload, largest_live_cuda_tensors, report_leftovers
from trainers_megatron.optim import (
    OptimizerStep,
    adam_optimizers,
    build_optimizer,
    build_scheduler,
    optimizers,
    wrap_ddp,
)
from trainers_megatron.schedule import run_schedule
from vlm_models.build import resolve_config
from vlm_models.hub import resolve_model_source
from vlm_models.megatron import (
    Parallelism,
    Qwen3VLMegatronModel,
    apply_cpu_compat,
    build_megatron_model,
    compile_decoder_layers,
    compile_vision_blocks,
    compiles_by_default,
    initialize_model_parallel,
    iter_hf_weights,
    text_arch,
)

logger = logging.getLogger(__name__)
#: what a colocated trainer keeps at each release (``rl_runtime.workers.MEMORY_LOGGER``)
memory_logger = logging.getLogger("glimpse.memory")


class MegatronActor:
    """Megatron-Core policy model with the trainer protocol.

    Example::

        actor = MegatronActor(MegatronConfig(model="qwen3-vl-tiny", tp=2, sp=True))
        batch.old_logprobs = actor.compute_logprobs(batch)
        metrics = actor.train_step(batch, loss="grpo")
    """

    def __init__(self, config: MegatronConfig) -> None:
        # Before any process group: a folder without weights, a missing one or an unreachable
        # hub id stops here; only a preset name or a config object means random weights.
        if isinstance(config.model, (str, os.PathLike)):
            source = resolve_model_source(str(config.model), require_weights=True)
            config = dataclasses.replace(config, model=source)
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        default_dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, config.param_dtype or default_dtype)
        self.hf_config = resolve_config(config.model, **config.model_overrides)
        if config.optimizer_offload > 0 and self.dtype == torch.float32:
            # megatron-core 0.16.1's precision-aware distributed optimizer takes float32
            # weights' shards as views that keep their autograd history (torch refuses to
            # optimize them), and its device half would step them through an empty .grad
            raise ValueError(
                "optimizer offload on the megatron backend needs bf16 weights "
                "(--param-dtype bfloat16; the default on GPUs)"
            )
        if config.ep > 1 and not text_arch(self.hf_config).num_experts:
            raise ValueError(f"ep={config.ep} (expert parallel) needs an MoE model")
        if config.routing_replay and not text_arch(self.hf_config).num_experts:
            raise ValueError("routing_replay needs an MoE model")
        if self.device.type == "cpu":
            # megatron-core 0.16.1 assumes CUDA in a few places; CPU runs (tests, debugging)
            # need the compatibility layer, which refuses to run where CUDA exists.
            apply_cpu_compat()
        parallel = Parallelism(
            tp=config.tp, pp=config.pp, ep=config.ep, sp=config.sp, etp=config.etp, cp=config.cp
        )
        log_compiles(triton_autotune=self.device.type == "cuda")  # what the first step compiles
        startup = StartupLog(f"megatron trainer rank {os.environ.get('RANK', 0)}")
        with startup.phase("process groups"):
            initialize_model_parallel(parallel, seed=config.seed)
        self.rank = dist.get_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        # the ranks that split the samples; context-parallel ranks share theirs (gradients
        # are reduced over both, by megatron-core's DDP)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        settings = model_settings(config)
        with startup.phase("model"):
            self.module: Qwen3VLMegatronModel = build_megatron_model(
                self.hf_config, parallel, params_dtype=self.dtype, **settings
            )
        # a packed row must keep its samples apart in every layer (Qwen3.5's gated delta net
        # resets its state at sample boundaries); a model that cannot runs one per row
        self.one_sample_per_micro_batch = not self.module.packs_samples
        if self.one_sample_per_micro_batch:
            logger.warning(
                "%s: a packed row would carry linear-attention state across samples; running "
                "one sample per micro-batch",
                type(self.module).__name__,
            )
        with startup.phase("initial weights"):
            load_initial_weights(self.module, config, self.hf_config)
        self.compiled = config.compile
        if self.compiled is None:
            self.compiled = self.device.type == "cuda" and compiles_by_default(self.hf_config)
        if self.compiled:
            backend = "inductor" if self.device.type == "cuda" else "aot_eager"
            compile_decoder_layers(self.module, backend=backend)
            compile_vision_blocks(self.module, backend=backend)
        self.ref_model = None
        if config.reference_model:  # the initial policy, frozen: the KL penalty's reference
            with startup.phase("reference model"):
                self.ref_model = build_megatron_model(
                    self.hf_config, parallel, params_dtype=self.dtype, **settings
                )
                self.ref_model.load_state_dict(self.module.state_dict())
                self.ref_model.requires_grad_(False).eval()
        # megatron-core's DDP (float32 gradient buffers) and optimizer (see trainers_megatron.optim)
        with startup.phase("DDP and optimizer"):
            self.model = wrap_ddp(self.module, distributed_optimizer=config.distributed_optimizer)
            self.optimizer = build_optimizer(
                self.model,
                lr=config.optim.lr,
                min_lr=config.optim.min_lr,
                betas=config.optim.betas,
                eps=config.optim.eps,
                weight_decay=config.optim.weight_decay,
                distributed_optimizer=config.distributed_optimizer,
                offload=config.optimizer_offload,
                overlap_offload=config.overlap_cpu_optimizer_d2h_h2d,
            )
            self._step = OptimizerStep(
                self.optimizer,
                flat=config.flat_masters,
                host_threads=config.host_optimizer_threads,
                pieces=config.overlap_cpu_optimizer_d2h_h2d,
            )
        startup.done()
        self.scheduler = build_scheduler(self.optimizer, config.optim)
        self.step = 0
        self._offload = StorageOffload()
        # the DDP gradient buffers hold zeros (built so, zeroed after each update): an offload
        # frees them without a copy
        self._grads_zero = True
        # reused pinned host buffers: each micro-batch reaches the GPU in one copy
        self._staging = PinnedStaging() if self.device.type == "cuda" else None

    # ----------------------------------------------------------------------------- batches
    def micro_batches(self, batch: TrainBatch, fields: Sequence[str] = ()) -> MicroBatches:
        """The micro-batches of this rank's samples (``max_tokens_per_gpu`` each), built and
        copied to the device as iterated. Under sequence parallelism each row is padded (one
        extra sample) to a multiple of TP so every rank gets an equal slice. Under context
        parallelism each sample is padded instead, and cut zigzag (:func:`split_row`)."""
        pad = self.tp_size if self.config.sp else 1
        vision = self.module.vision_inputs
        cp = self.cp_size
        replay = replays_routes(batch, self.config.routing_replay)

        def build(indices: Sequence[int]) -> MicroBatch:
            with record_function("megatron_actor.micro_batch"):  # host work the GPU may wait on
                mb = build_micro_batch(
                    batch,
                    indices,
                    self.hf_config,
                    fields=fields,
                    pad_to_multiple=1 if cp > 1 else pad,
                    routed_experts=replay,
                )
                if cp > 1:
                    mb.context_parallel = split_row(
                        mb,
                        cp=cp,
                        rank=self.cp_rank,
                        group=self.cp_group,
                        multiple=pad,
                        device=self.device,
                    )
                if vision is not None and mb.image_grid_thw is not None:
                    # computed here; the grid then stays on the host, read there as a list
                    mb.vision_inputs = vision.compute(mb.image_grid_thw)
                return mb.to(self.device, self._staging)

        plan = plan_micro_batches(
            batch.lengths,
            self.config.max_tokens_per_gpu * cp,
            one_per_micro_batch=self.one_sample_per_micro_batch,
            ep=self.config.ep,
            dp_group=self.dp_group,
            device=self.device,
        )
        return MicroBatches(plan, build)

    def _stage_forward(self, mb: MicroBatch, model: torch.nn.Module) -> Tensor:
        """:func:`~trainers_megatron.forward.stage_forward` on this rank's stage: hidden
        states for the next stage, or on the last the aligned log-probs ``[T_real]``."""
        return stage_forward(self, mb, model)

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` as the last pipeline stage has it, on every stage."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return value
        holder = [value]
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(holder, src=src, group=self.pp_group)
        return holder[0]

    # ----------------------------------------------------------------------------- protocol
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample log-probs ``[L_i]`` (float32, CPU) of this rank's samples, under the
        policy or (``reference=True``) the frozen initial weights; on every pipeline stage."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("reference=True needs MegatronConfig(reference_model=True)")
        self._require_onloaded()
        batch = group_batch(batch, self.cp_group)
        model.eval()
        out: list[Tensor | None] = [None] * len(batch)

        def keep(mb: MicroBatch, logprobs: Tensor) -> Tensor:
            real = logprobs.float().cpu()[: mb.num_real_tokens].split(mb.lengths[: len(mb.indices)])
            for i, part in zip(mb.indices, real, strict=True):
                out[i] = part
            return logprobs.new_zeros(())

        try:
            run_schedule(
                model, self.micro_batches(batch), self._stage_forward, keep, forward_only=True
            )
        finally:
            clear_replayed_routes(self, model)
        return self._from_last_stage(out)

    def _loss(self, loss: str | TrainLoss) -> TrainLoss:
        cfg = self.config
        return resolve_loss(loss, grpo=cfg.grpo, sft_agg_mode=cfg.sft_loss_agg_mode)

    def train_step(self, batch: TrainBatch, *, loss: str | TrainLoss = "grpo") -> dict[str, float]:
        """One optimizer step over the global batch (this rank's part), the step of
        :mod:`rl_algos.train_step` over this actor's hooks; metrics are global (the loss's
        from the last pipeline stage)."""
        self._require_onloaded()
        return self._from_last_stage(
            core.train_step(self, group_batch(batch, self.cp_group), self._loss(loss))
        )

    def forward_backward(
        self, batch: TrainBatch, *, loss: str | TrainLoss = "grpo"
    ) -> dict[str, float]:
        """Accumulate the gradient of the global-batch loss; no optimizer step."""
        self._require_onloaded()
        return self._from_last_stage(
            core.forward_backward(self, group_batch(batch, self.cp_group), self._loss(loss))
        )

    def optimizer_step(self) -> dict[str, float]:
        """Reduce and clip the gradients, step AdamW and the LR schedule (skipped for a
        non-finite gradient norm, reported as ``update_skipped``)."""
        return core.optimizer_step(self)

    # ------------------------------------------------------------ the trainer step's hooks
    @property
    def group(self) -> Any:
        """The step's samples are split over the data-parallel ranks (replica peers share them)."""
        return self.dp_group

    @property
    def reports_progress(self) -> bool:
        """The rank that logs a step's micro-batch progress (`rl_algos.train_step`): the first
        of the last pipeline stage, where the loss is computed."""
        first = parallel_state.get_tensor_model_parallel_rank() == 0 and self.cp_rank == 0
        return self.last_stage and first and parallel_state.get_data_parallel_rank() == 0

    def run_micro_batches(
        self, micro_batches: MicroBatches, loss_fn: MicroBatchLoss, *, entropy: EntropyMode
    ) -> None:
        """Forward, loss and backward of every micro-batch under megatron-core's schedule
        (``loss_fn`` is the schedule's per-micro-batch loss, on the last stage). No entropy:
        the vocabulary-parallel entropy is not written yet."""
        if entropy == "grad":
            raise ValueError("the Megatron actor has no entropy bonus (grpo.entropy_coef)")
        self.model.train()
        self._grads_zero = False
        with record_function("megatron_actor.micro_batches"):
            try:
                run_schedule(
                    self.model,
                    micro_batches,
                    self._stage_forward,
                    lambda mb, logprobs: loss_fn(mb, logprobs, None),
                )
            finally:
                clear_replayed_routes(self, self.model)

    def finish_grads(self) -> Tensor:
        """Finish the gradients with megatron-core's ``finalize_model_grads`` (DP
        reduce-scatter or all-reduce, SP norms and QK-norms over TP, tied embeddings over the
        first and last stages), hand them to the optimizer's main gradients; their global
        norm, on the device."""
        with record_function("megatron_actor.finish_grads"):
            finalize_model_grads([self.model])
            return self._step.prepare_grads()

    def apply_update(self, grad_norm: float | None) -> float:
        """Clip to ``max_grad_norm`` and step (``None``: no update, the schedule stays);
        the gradients are dropped either way. Returns this step's LR."""
        with record_function("megatron_actor.optimizer"):
            if grad_norm is not None:
                self.scheduler.step(1)  # this step's LR (the scheduler counts steps from 1)
                # AdamW on the float32 masters, then the weights (all-gathered under the
                # distributed optimizer)
                self._step.step(grad_norm, self.config.optim.max_grad_norm)
            self._step.zero_grad(self.model)
            self._grads_zero = True
        return self.optimizer.param_groups[0]["lr"]

    # ----------------------------------------------------------------------------- weights
    def iter_hf_weights(
        self, bucket_bytes: int = 1 << 30, *, device: str | None = "cpu", wire: bool = True
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Full HF-named tensors (``export_dtype``, on ``device``; None: the weights' own) in
        buckets, on every rank; collective over TP, PP (each stage broadcasts its part) and EP
        (each rank's experts gathered). In the checkpoint files' layout, the one wire layout
        every engine's loader reads (``wire=False``: transformers' in-memory layout)."""
        self._require_onloaded()
        dtype = getattr(torch, self.config.export_dtype)
        for bucket in iter_hf_weights(self.module, bucket_bytes, file_layout=wire):
            yield [(n, t.to(device=device, dtype=dtype)) for n, t in bucket]

    def export_hf(self, path: str | os.PathLike) -> None:
        """An HF folder that ``from_pretrained`` loads (trainers_megatron.checkpoint)."""
        export_hf(self, path)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Each rank's shard and optimizer state (trainers_megatron.checkpoint)."""
        self._require_onloaded()
        save_checkpoint(self, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from :meth:`save_checkpoint`'s folder (same world size and layout)."""
        self._require_onloaded()
        load_checkpoint(self, path)

    # ----------------------------------------------------------------------------- offload
    def _device_tensors(self) -> Iterator[Tensor]:
        """Everything the actor keeps on the GPU: parameters, buffers, DDP gradient (and,
        under the distributed optimizer, parameter) buffers, optimizer masters and moments,
        the reference model. A hybrid optimizer's host masters and moments are named among
        the optimizers' state but are not the device's: left out (where the CPU plays the
        device they are of its type and move with the rest)."""
        device = self.device.type
        return (t for t in self._state_tensors() if t.device.type == device)

    def _state_tensors(self) -> Iterator[Tensor]:
        modules = [self.module] + ([self.ref_model] if self.ref_model is not None else [])
        for module in modules:
            yield from module.parameters()
            yield from module.buffers()
        for buffer in self._ddp_buffers():
            for t in (buffer.param_data, buffer.grad_data):
                if t is not None:
                    yield t
        for opt in optimizers(self.optimizer):
            for p in opt.get_parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            for state in opt.optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, Tensor))
        for inner in adam_optimizers(self.optimizer):  # a hybrid's own copies, before a step too
            for group in inner.param_groups:
                yield from group["params"]
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, Tensor))

    def _ddp_buffers(self) -> list[Any]:
        return list(self.model.buffers) + list(self.model.expert_parallel_buffers)

    def _move_out(self) -> int:
        """Everything on the GPU to the host (:class:`StorageOffload`); the gradient buffers,
        when they hold zeros, freed without a copy. Bytes copied."""
        drop = [b.grad_data for b in self._ddp_buffers() if b.grad_data is not None]
        return self._offload.offload(
            (t for t in self._device_tensors() if t.device.type == self.device.type),
            drop=drop if self._grads_zero else (),
        )

    def offload(self) -> dict[str, float]:
        """Move parameters, gradient buffers, master weights and optimizer state to the host
        (frees the GPU; views into megatron-core's buffers stay valid). Returns the copy's
        metrics (:func:`trainer_core.offload.transfer_metrics`; none on a CPU)."""
        if self.device.type == "cpu":
            return {}
        with timed_copies(self.device) as seconds:
            moved = self._move_out()
        torch.cuda.empty_cache()
        logger.info("offloaded %.1f GiB to the host in %.2f s", moved / 2**30, seconds[0])
        report_leftovers()
        return transfer_metrics("offload", moved, seconds[0])

    def onload(self) -> dict[str, float]:
        """Bring back everything :meth:`offload` moved; returns the copy's metrics."""
        if not self._offload.offloaded:
            return {}
        with timed_copies(self.device) as seconds:
            moved = self._offload.onload()
        return transfer_metrics("onload", moved, seconds[0])

    def release_cache(self) -> None:
        """Drop what the last forward left (the MoE dispatchers' per-token tensors) and give
        the allocator's cached, unused blocks back to the device (a colocated engine resumes
        next); the model and optimizer state stay where they are. Logged at each call with
        what stays allocated and reserved (segments that hold a live block cannot be given
        back), and at the first with the largest tensors that hold it (the Qwen3.5 cut's
        trainer kept 11 GiB past its plan on an H100, 2026-12-06)."""
        for model in (self.module, self.ref_model):
            if model is not None:
                drop_dispatch_state(model)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            first = not getattr(self, "_kept_named", False)
            self._kept_named = True
            reserved = torch.cuda.memory_reserved()
            memory_logger.info(
                "release_cache: %.1f GiB of cached GPU memory given back; %.1f GiB allocated "
                "stays, %.1f GiB reserved%s",
                (before - reserved) / 2**30,
                torch.cuda.memory_allocated() / 2**30,
                reserved / 2**30,
                f"; largest tensors: {largest_live_cuda_tensors()}" if first else "",
            )

    def _require_onloaded(self) -> None:
        if self._offload.offloaded:
            raise RuntimeError("the actor is offloaded: call onload() first")
