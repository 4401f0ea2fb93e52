"""The FSDP2 actor: log-probs, GRPO / SFT optimizer steps, weight export, checkpoints, offload.

It implements the trainer protocol (``rl_runtime.protocols.TrainActor``). One actor runs in each rank's
process; every method is collective (all ranks call it, each with its own part of the batch).
The model is a plain transformers model (``vlm_models.build_model``) with parallelism applied
by :mod:`trainers_fsdp.parallelize`. In a world of one there is nothing to shard: the model
trains directly, in bf16 over float32 master weights (:mod:`trainers_fsdp.master`), unless
``FsdpConfig.shard_single_rank`` asks for FSDP anyway. ``FsdpConfig.replicate`` trains that way
on several ranks too, averaging the gradients with one all-reduce (data parallel without
sharding, for models that fit on one GPU).

The actor holds the state and the order of things; its parts live beside it: the models built
at start-up (:mod:`trainers_fsdp.model`), the packed forward both passes run
(:mod:`trainers_fsdp.forward`), the micro-batch plan (:mod:`trainers_fsdp.microbatch`), the
optimizer (:mod:`trainers_fsdp.optim`), weight export (:mod:`trainers_fsdp.weights`),
checkpoints (:mod:`trainers_fsdp.checkpoint`) and the state moved around a colocated rollout
(:mod:`trainers_fsdp.offload`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from rl_algos import (
    EntropyMode,
    MicroBatches,
    MicroBatchLoss,
    TrainBatch,
    TrainLoss,
    collect_logprobs,
    resolve_loss,
    run_sequentially,
)
from rl_algos import train_step as core
from trainer_core import MicroBatch, PinnedStaging, build_micro_batch, replays_routes
from trainer_core.compile_log import log_compiles
from trainer_core.offload import timed_copies, transfer_metrics
from trainer_core.startup import StartupLog
from trainers_fsdp.checkpoint import load_checkpoint, save_checkpoint
from trainers_fsdp.config import FsdpConfig
from trainers_fsdp.distributed import (
    all_reduce_mean_,
    build_mesh,
    init_distributed,
    resolve_device,
)
from trainers_fsdp.flat_adamw import FlatAdamW
from trainers_fsdp.forward import packed_forward
from trainers_fsdp.master import MasterWeights
from trainers_fsdp.microbatch import plan_micro_batches
from trainers_fsdp.model import ModelBuilder, check_offload, torch_dtype
from trainers_fsdp.offload import free_grad_buffers, move_state, release_cached_memory
from trainers_fsdp.optim import (
    build_optimizer,
    build_scheduler,
    clip_coefficient,
    grad_norm,
    step_with_scaled_grads,
)
from trainers_fsdp.vision import VisionInputs
from trainers_fsdp.weights import export_hf_folder, iter_hf_weight_buckets
from vlm_models.linear_attention import has_linear_attention
from vlm_models.packing import supports_packed_forward
from vlm_models.routing_replay import clear_routes, replaying, set_routes

logger = logging.getLogger(__name__)


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class FsdpActor:
    """FSDP2 policy (and optional reference) model with the trainer protocol.

    Example::

        actor = FsdpActor(FsdpConfig(model="qwen3-vl-tiny", max_tokens_per_gpu=4096))
        old = actor.compute_logprobs(batch)
        batch.old_logprobs = old
        metrics = actor.train_step(batch, loss="grpo")
    """

    def __init__(self, config: FsdpConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self._owns_process_group = not dist.is_initialized()
        log_compiles(triton_autotune=self.device.type == "cuda")  # what the first step compiles
        startup = StartupLog(f"fsdp trainer rank {os.environ.get('RANK', 0)}")
        with startup.phase("process group"):
            self.rank, self.world_size = init_distributed(
                self.device, timeout_s=config.dist_timeout_s
            )
            self.mesh = build_mesh(self.device)
        default_dtype = "bfloat16" if self.device.type == "cuda" else None
        self.param_dtype = torch_dtype(config.param_dtype or default_dtype)
        if config.optimizer_offload > 0:
            check_offload(
                config, world_size=self.world_size, param_dtype=self.param_dtype, device=self.device
            )
        # reused pinned host buffers: each micro-batch reaches the GPU in one copy (PinnedStaging)
        self._staging = PinnedStaging() if self.device.type == "cuda" else None
        models = ModelBuilder(config, self.device, self.mesh, self.world_size, self.param_dtype)
        with startup.phase("model (build, load, shard)"):
            self.model = models.build(trainable=True)
        self.ref_model = None
        if config.reference_model:
            with startup.phase("reference model"):
                self.ref_model = models.build(trainable=False)
        self.compile = models.compile  # decided by the model built (compile_by_default)
        self._vision_inputs: dict[int, VisionInputs | None] = models.vision_inputs  # by id(model)
        self._masters: MasterWeights | None = models.masters  # one rank, low-precision compute
        # Linear-attention layers get the sample boundaries too (their state resets there).
        self._linear_attention = has_linear_attention(self.model.config)
        self._one_per_micro_batch = not all(
            supports_packed_forward(m) for m in (self.model, self.ref_model) if m is not None
        )
        if self._one_per_micro_batch:
            logger.warning(
                "%s: a packed forward would mix samples (linear-attention layers that do not "
                "reset at sample boundaries); running one sample per micro-batch",
                type(self.model).__name__,
            )
        with startup.phase("optimizer"):
            self.optimizer = build_optimizer(
                self._trained,
                config.optim,
                self.device,
                self._masters,
                host_threads=config.host_optimizer_threads,
                fused=config.fused_adamw,
                flat_update=config.flat_update,
            )
            self.scheduler = build_scheduler(self.optimizer, config.optim)
        startup.done()
        self.step = 0
        self._offloaded = False
        self._grads_averaged = True  # replicate: nothing accumulated since the last average
        torch.manual_seed(config.seed + self.rank)

    @property
    def _trained(self) -> nn.Module:
        """The module whose parameters the optimizer steps and checkpoints hold: the float32
        masters of a one-rank bf16 actor, else the (FSDP) model itself."""
        return self.model if self._masters is None else self._masters.module

    @property
    def model_config(self):
        return self.model.config

    # ----------------------------------------------------------------------------- forward
    def micro_batches(
        self, batch: TrainBatch, fields: Sequence[str] = (), model: nn.Module | None = None
    ) -> MicroBatches:
        """The step's micro-batches (the same count on every rank), each built and copied to
        the device as it is iterated. ``fields``: the per-token fields the loss reads."""
        plan = plan_micro_batches(
            batch.lengths,
            self.config.max_tokens_per_gpu,
            one_per_micro_batch=self._one_per_micro_batch,
        )
        need_vision = self.world_size > 1
        vision = self._vision_inputs.get(id(model or self.model))
        replay = replays_routes(batch, self.config.routing_replay)

        def build(indices: Sequence[int]) -> MicroBatch:
            with record_function("fsdp_actor.micro_batch"):  # host work the GPU may wait on
                mb = build_micro_batch(
                    batch,
                    indices,
                    self.model_config,
                    fields=fields,
                    need_vision=need_vision,
                    routed_experts=replay,
                )
                if vision is not None and mb.image_grid_thw is not None:
                    mb.vision_inputs = vision.compute(mb.image_grid_thw)
                return mb.to(self.device, self._staging)

        return MicroBatches(plan, build)

    def _forward(
        self, model: nn.Module, mb: MicroBatch, *, entropy: EntropyMode = None
    ) -> tuple[Tensor, Tensor | None]:
        """:func:`~trainers_fsdp.forward.packed_forward` of ``model`` (the policy or the
        reference) with this actor's settings: aligned log-probs ``[T]`` and optionally
        entropy ``[T]``."""
        return packed_forward(
            model,
            mb,
            self.config,
            vision=self._vision_inputs.get(id(model)),
            linear_attention=self._linear_attention,
            compiled=bool(self.compile),
            entropy=entropy,
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample log-probs ``[L_i]`` (float32, CPU) under the policy or the reference."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("reference=True needs FsdpConfig(reference_model=True)")
        self._require_onloaded()
        was_training = model.training
        model.eval()

        def forward(mb: MicroBatch) -> Tensor:
            with replaying(model, mb.routed_experts):
                return self._forward(model, mb)[0]

        out = collect_logprobs(self.micro_batches(batch, model=model), forward, len(batch))
        model.train(was_training)
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- training
    def _loss(self, loss: str | TrainLoss) -> TrainLoss:
        cfg = self.config
        return resolve_loss(loss, grpo=cfg.grpo, sft_agg_mode=cfg.sft_loss_agg_mode)

    def train_step(self, batch: TrainBatch, *, loss: str | TrainLoss = "grpo") -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's part of the global batch): the step
        of :mod:`rl_algos.train_step` over this actor's hooks. Returns global metrics with
        ``tokens``, ``perf/train_step_s`` and ``tokens_per_s``; the host reads the device once, and
        the update is queued behind that read without waiting for it, so whatever the host
        does next overlaps the optimizer on the GPU."""
        self._require_onloaded()
        return core.train_step(self, batch, self._loss(loss), log_entropy=self.config.log_entropy)

    def forward_backward(
        self, batch: TrainBatch, *, loss: str | TrainLoss = "grpo"
    ) -> dict[str, float]:
        """Accumulate the gradient of the global-batch loss; no optimizer step (the loss
        scaling is :mod:`rl_algos.train_step`'s: the result equals one big batch's)."""
        self._require_onloaded()
        return core.forward_backward(
            self, batch, self._loss(loss), log_entropy=self.config.log_entropy
        )

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step AdamW and the LR schedule, zero the gradients. A non-finite gradient
        norm skips the update (reported as ``update_skipped``)."""
        return core.optimizer_step(self)

    # ------------------------------------------------------------ the trainer step's hooks
    @property
    def group(self) -> None:
        """The step's samples are split over all ranks (the default process group)."""
        return None

    def run_micro_batches(
        self, micro_batches: MicroBatches, loss_fn: MicroBatchLoss, *, entropy: EntropyMode
    ) -> None:
        """Forward, loss and backward, one micro-batch after the other."""
        self.model.train()

        def forward(mb: MicroBatch) -> tuple[Tensor, Tensor | None]:
            # routes stay set through this micro-batch's backward, where activation
            # checkpointing recomputes the layers (the next forward replaces them)
            if mb.routed_experts is not None:
                set_routes(self.model, mb.routed_experts)
            elif self.config.routing_replay:
                clear_routes(self.model)
            return self._forward(self.model, mb, entropy=entropy)

        def backward(value: Tensor) -> None:
            # FSDP averages gradients over ranks; multiplying by world size makes it a sum.
            self._backward(value * self.world_size if self.world_size > 1 else value)

        with record_function("fsdp_actor.micro_batches"):
            try:
                run_sequentially(micro_batches, forward, backward, loss_fn)
            finally:
                if self.config.routing_replay:
                    clear_routes(self.model)

    def _backward(self, loss: Tensor) -> None:
        """``loss.backward()``; with one-rank master weights, the bf16 gradient buffer is first
        emptied into the float32 one, so micro-batches sum in float32."""
        if self._masters is not None:
            self._masters.before_backward()
        with record_function("fsdp_actor.backward"):
            loss.backward()
        self._grads_averaged = False

    def _average_grads(self) -> None:
        """Replicated ranks (``FsdpConfig.replicate``): average the accumulated gradients over
        ranks before anything reads them (FSDP reduces inside its backward instead). Averaging
        again after more backwards is still right: the averaged part is the same everywhere."""
        if self._grads_averaged or not self.config.replicate or self.world_size == 1:
            return
        with record_function("fsdp_actor.all_reduce"):
            if self._masters is not None:
                self._masters.all_reduce_grads(torch_dtype(self.config.reduce_dtype))
            else:  # float32 compute: one all-reduce over the gradients laid end to end
                params = [p for p in self.model.parameters() if p.requires_grad]
                grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
                flat = all_reduce_mean_(torch.cat([g.reshape(-1) for g in grads]))
                parts = flat.split([g.numel() for g in grads])
                for p, g, part in zip(params, grads, parts, strict=True):
                    p.grad = g.copy_(part.view_as(g))
        self._grads_averaged = True

    def finish_grads(self) -> Tensor:
        """The global norm of the accumulated gradients, on the device (replicated ranks
        average theirs first; FSDP reduced them in its backward). Clipping waits for the
        update, which scales the gradients as it reads them."""
        self._average_grads()
        with record_function("fsdp_actor.grad_norm"):
            if isinstance(self.optimizer, FlatAdamW):  # the master weights' own buffers
                return self.optimizer.grad_norm()
            return grad_norm(self._trained.parameters())

    def apply_update(self, grad_norm: float | None) -> float:
        """Clip and step, then the LR schedule; ``None`` (a non-finite norm): no update, the
        schedule stays. The gradients are dropped either way. Returns this step's LR. Nothing
        here waits for the GPU."""
        lr = self.scheduler.get_last_lr()[0]
        with record_function("fsdp_actor.optimizer"):
            if grad_norm is not None:
                coef = clip_coefficient(grad_norm, self.config.optim.max_grad_norm)
                step_with_scaled_grads(self.optimizer, coef)
            self.zero_grad()
        if grad_norm is not None:
            self.scheduler.step()
        return lr

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (:meth:`forward_backward` adds to them)."""
        self._grads_averaged = True
        if self._masters is not None:
            self._masters.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def full_parameters(self) -> dict[str, Tensor]:
        """Every trained parameter, full and float32 where it is kept so (master weights), by
        name. Collective; for tests and inspection, not for the weight sync."""
        return {n: _full(p).detach().clone() for n, p in self._trained.named_parameters()}

    def full_gradients(self) -> dict[str, Tensor]:
        """The accumulated gradients (full, float32 where reduced so), by name. Collective."""
        self._average_grads()
        if self._masters is not None:
            self._masters.ready_grads()
        return {
            n: _full(p.grad).clone()
            for n, p in self._trained.named_parameters()
            if p.grad is not None
        }

    # ----------------------------------------------------------------------------- weights
    def iter_hf_weights(
        self, bucket_bytes: int = 1 << 30, *, device: str | None = "cpu"
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Full (unsharded) HF-named tensors in buckets of at most ``bucket_bytes``, on
        ``device`` (None: the weights' own, for a transport that reads GPU memory).

        Names and shapes are the original checkpoint's (the GEMM patch embedding keeps the
        Conv3d parameter); tied ``lm_head.weight`` is left out as checkpoints do. Collective.
        """
        self._require_onloaded()
        dtype = torch_dtype(self.config.export_dtype)
        yield from iter_hf_weight_buckets(
            self.model, bucket_bytes, dtype, device=device, state=self._export_state(dtype)
        )

    def export_hf(self, path: str | os.PathLike, *, dtype: str | None = None) -> None:
        """Write an HF folder that ``Qwen3VLForConditionalGeneration.from_pretrained`` loads."""
        self._require_onloaded()
        wanted = torch_dtype(dtype or self.config.export_dtype)
        export_hf_folder(self.model, path, dtype=wanted, state=self._export_state(wanted))

    def _export_state(self, dtype: torch.dtype) -> dict[str, Tensor] | None:
        """What weight export reads instead of the model's state dict (None: the state dict).

        The float32 masters, unless ``dtype`` is the compute dtype: the compute weights are
        then already the masters cast to it (every optimizer step, load and onload ends with
        that cast, round-to-nearest on either device), and they are on the GPU, where the
        masters may be on the host. For the 8B with 90 % of the optimizer on the host, reading
        the masters cast 29 GB of float32 on the CPU and crossed PCIe from pageable memory at
        every push (13.7 s of a 31.5 s step on the H200, 2026-12-04)."""
        if self._masters is None or self._masters.compute.dtype == dtype:
            return None
        return self._masters.state_dict()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Model, optimizer, scheduler, RNG and step with torch.distributed.checkpoint."""
        self._require_onloaded()
        with self._checkpoint_scope():
            save_checkpoint(path, self._trained, self.optimizer, self.scheduler, self.step)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume exactly from :meth:`save_checkpoint`'s folder."""
        self._require_onloaded()
        with self._checkpoint_scope():
            self.step = load_checkpoint(path, self._trained, self.optimizer, self.scheduler)
        if self._masters is not None:
            self._masters.copy_to_model()

    def _checkpoint_scope(self):
        return nullcontext() if self._masters is None else self._masters.grads_detached()

    # ----------------------------------------------------------------------------- offload
    def offload(self) -> dict[str, float]:
        """Move parameters, gradients and optimizer state to CPU (frees the GPU for rollout);
        gradients that hold nothing are freed instead (:meth:`release_grads`). Returns the
        copy's metrics (:func:`trainer_core.offload.transfer_metrics`; none on a CPU)."""
        if self.device.type == "cpu":
            return {}
        self.release_grads()
        with timed_copies(self.device) as seconds:
            moved = self._move(torch.device("cpu"), offload=True)
        torch.cuda.empty_cache()
        self._offloaded = True
        return transfer_metrics("offload", moved, seconds[0])

    def onload(self) -> dict[str, float]:
        """Bring everything :meth:`offload` moved back to the GPU; returns the copy's metrics."""
        if self.device.type == "cpu":
            return {}
        with timed_copies(self.device) as seconds:
            moved = self._move(self.device, offload=False)
        self._offloaded = False
        return transfer_metrics("onload", moved, seconds[0])

    def release_cache(self) -> None:
        """Before a colocated engine resumes: free what only a step needs, so that the engine's
        KV cache gets it, and say what stays. The gradients when nothing is accumulated
        (:meth:`release_grads`), then, on CUDA, blocks a CUDA-IPC push shared with the engine
        that it has let go (``torch.cuda.ipc_collect``) and the allocator's cache (the step's
        activations and logits, the push's buffers). The weights and the optimizer state stay:
        what the colocation plan counts (``FsdpConfig.resident_bytes``), logged beside what
        is still allocated."""
        freed = self.release_grads()
        if self.device.type == "cuda":
            release_cached_memory(self.device, freed=freed, planned=self.planned_resident_bytes())

    def release_grads(self) -> int:
        """Free the gradient buffers while they hold nothing (after an optimizer step, or
        before the first); returns the bytes freed. The one-rank masters' flat bf16 and float32
        buffers (6 bytes a trainable parameter) and the optimizer's views of them; FSDP's and
        float32 training's ``.grad`` are already None after a step (``zero_grad``). An
        accumulated gradient (``forward_backward`` without its step) is kept. The next backward
        makes them again."""
        return free_grad_buffers(self._masters, self.optimizer)

    def planned_resident_bytes(self) -> float:
        """What the colocation plan counts for this rank while the engine generates
        (``FsdpConfig.resident_bytes`` of this model and layout)."""
        from rl_algos.run_context import ModelShape, ParallelLayout, TrainLayout
        from vlm_models.sources import model_shape

        cfg = self.config
        shape = ModelShape(**model_shape(self.model_config))
        parallel = ParallelLayout(optimizer_offload=cfg.optimizer_offload)
        return cfg.resident_bytes(shape, TrainLayout(self.world_size, 1, parallel))

    def _move(self, device: torch.device, *, offload: bool) -> int:
        """The actor's state to ``device`` (:func:`trainers_fsdp.offload.move_state`); bytes
        copied."""
        return move_state(self.model, self._masters, self.optimizer, device, offload=offload)

    def _require_onloaded(self) -> None:
        if self._offloaded:
            raise RuntimeError("the actor is offloaded: call onload() first")

    def close(self) -> None:
        """Destroy the process group if this actor created it, once every rank is done with it
        (a rank tearing gloo down while a peer still talks to it can abort the process)."""
        if self._owns_process_group and dist.is_initialized():
            if self.world_size > 1:
                dist.barrier()
            dist.destroy_process_group()
