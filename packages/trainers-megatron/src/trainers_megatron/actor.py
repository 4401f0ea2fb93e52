"""The Megatron-Core actor: log-probs, GRPO / SFT optimizer steps, weight export, checkpoints.

It implements the trainer protocol of ``docs/architecture.md`` on
:mod:`vlm_models.megatron` (native Megatron decoder + HF vision tower). One actor runs in each
rank's process; every method is collective. Ranks of one tensor-parallel group work on the
same samples (the group's first rank's batch is broadcast to the others); data-parallel
replicas each take their own part of the global batch.

Samples are packed into THD micro-batches of at most ``max_tokens_per_gpu`` tokens. Gradients
are reduced by hand (no Megatron DDP wrapper): sequence-parallel norms and QK-norms over the TP
group, everything over the data-parallel group. With ``param_dtype`` below float32 the
optimizer (torch AdamW) keeps float32 master weights.

Limits of this first version: no pipeline parallelism, no expert parallelism, no distributed
optimizer. Log-probs use Megatron's vocab-parallel cross entropy, so full-vocabulary logits are
never gathered; ``reference_model=True`` keeps a frozen copy of the initial weights for KL.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from safetensors.torch import save_file
from torch import Tensor

from rl_algos import (
    EntropyMode,
    MicroBatches,
    MicroBatchLoss,
    TrainBatch,
    TrainLoss,
    aligned_logprobs,
    collect_logprobs,
    logprobs_from_logits,
    pack_by_token_budget,
    resolve_loss,
    run_sequentially,
    scatter_rows,
)
from rl_algos import train_step as core
from trainers_megatron.config import MegatronConfig
from vlm_models import (
    PRESETS,
    MicroBatch,
    PinnedStaging,
    build_micro_batch,
    build_model,
    resolve_config,
    resolve_model_source,
)
from vlm_models.megatron import (
    Parallelism,
    SafetensorsReader,
    apply_cpu_compat,
    build_megatron_model,
    compile_decoder_layers,
    compiles_by_default,
    initialize_model_parallel,
    iter_hf_weights,
    load_hf_weights,
)

logger = logging.getLogger(__name__)


def _vocab_parallel_aligned_logprobs(
    logits: Tensor, input_ids: Tensor, cu_seqlens: Tensor, temperature: float
) -> Tensor:
    """``rl_algos.aligned_logprobs`` for vocabulary-sharded logits ``[T, V / tp]``.

    Megatron's vocab-parallel cross entropy reduces over the TP group, so the full-vocabulary
    logits are never gathered (float32 on this rank's slice only).
    """
    next_ids = torch.roll(input_ids, -1)
    scaled = logits.float() / temperature
    lp = -tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None], next_ids[:, None])[:, 0]
    shifted = torch.cat([lp.new_zeros(1), lp[:-1]])
    first = torch.zeros_like(shifted, dtype=torch.bool)
    first[cu_seqlens[:-1].long()] = True
    return shifted.masked_fill(first, 0.0)


def _lr_scheduler(optimizer: torch.optim.Optimizer, config: MegatronConfig) -> Any:
    """megatron-core's scheduler over the AdamW groups: linear warmup from 0, then constant or
    cosine down to ``min_lr_ratio * lr`` at ``total_steps``; weight decay constant."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = config.warmup_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.lr,
        min_lr=config.lr * config.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(config.total_steps or 0, warmup + 1),
        lr_decay_style=config.lr_schedule,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


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
        if self.device.type == "cpu":
            # megatron-core 0.16.1 assumes CUDA in a few places; CPU runs (tests, debugging)
            # need the compatibility layer, which refuses to run where CUDA exists.
            apply_cpu_compat()
        initialize_model_parallel(Parallelism(tp=config.tp, sp=config.sp), seed=config.seed)
        self.rank = dist.get_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.hf_config = resolve_config(config.model, **config.model_overrides)
        recompute = (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            if config.recompute
            else {}
        )
        self.model = build_megatron_model(
            self.hf_config,
            Parallelism(tp=config.tp, sp=config.sp),
            params_dtype=self.dtype,
            **recompute,
        )
        self._load_initial_weights()
        self.compiled = config.compile
        if self.compiled is None:
            self.compiled = self.device.type == "cuda" and compiles_by_default(self.hf_config)
        if self.compiled:
            compile_decoder_layers(
                self.model, backend="inductor" if self.device.type == "cuda" else "aot_eager"
            )
        self.ref_model = None
        if config.reference_model:  # the initial policy, frozen: the KL penalty's reference
            self.ref_model = build_megatron_model(
                self.hf_config, Parallelism(tp=config.tp, sp=config.sp), params_dtype=self.dtype
            )
            self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.requires_grad_(False).eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # float32 master weights when the model computes in a lower precision
        self.masters = (
            self.params
            if self.dtype == torch.float32
            else [p.detach().float().clone().requires_grad_() for p in self.params]
        )
        decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                # wd_mult: megatron-core's scheduler sets every group's decay, times this
                {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
            ],
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
        )
        self.scheduler = _lr_scheduler(self.optimizer, config)
        self.step = 0
        self._offloaded = False
        # reused pinned host buffers: each micro-batch reaches the GPU in one copy
        self._staging = PinnedStaging() if self.device.type == "cuda" else None

    def _load_initial_weights(self) -> None:
        """The folder's weights; random ones only for a preset name or a config object."""
        source = self.config.model
        if isinstance(source, str) and source not in PRESETS:
            with SafetensorsReader(source) as reader:
                load_hf_weights(self.model, reader)
            return
        torch.manual_seed(self.config.seed)  # the same random init on every rank
        hf = build_model(self.hf_config)
        load_hf_weights(self.model, hf.state_dict())

    # ----------------------------------------------------------------------------- batches
    def _group_batch(self, batch: TrainBatch) -> TrainBatch:
        """The TP group's batch: its first rank's, on every rank of the group."""
        if self.tp_size == 1:
            return batch
        holder = [batch]
        src = parallel_state.get_tensor_model_parallel_src_rank()
        dist.broadcast_object_list(holder, src=src, group=self.tp_group)
        return holder[0]

    def micro_batches(self, batch: TrainBatch, fields: Sequence[str] = ()) -> MicroBatches:
        """The micro-batches of this rank's samples (``max_tokens_per_gpu`` each), built and
        copied to the device as iterated. Under sequence parallelism each row is padded (one
        extra sample) to a multiple of TP so every rank gets an equal slice."""
        pad = self.tp_size if self.config.sp else 1
        vision = self.model.vision_inputs

        def build(indices: Sequence[int]) -> MicroBatch:
            mb = build_micro_batch(
                batch, indices, self.hf_config, fields=fields, pad_to_multiple=pad
            )
            if vision is not None and mb.image_grid_thw is not None:
                # computed here; the grid then stays on the host, read there as a list
                mb.vision_inputs = vision.compute(mb.image_grid_thw)
            return mb.to(self.device, self._staging)

        return MicroBatches(
            pack_by_token_budget(batch.lengths, self.config.max_tokens_per_gpu), build
        )

    def _logprobs(self, mb: MicroBatch, model: torch.nn.Module | None = None) -> Tensor:
        """Aligned log-probs ``[T_real]`` (float32) of a packed micro-batch.

        Only the rows that predict loss tokens go through the output layer; other positions
        hold 0, which the token alignment convention allows (as in the FSDP actor).
        """
        longest = mb.max_seqlen
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seqlens,
            cu_seqlens_kv=mb.cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        positions = mb.loss_positions
        if positions is not None and positions.numel() == 0:
            positions = None  # nothing to score: the plain path keeps the graph whole
        logits = (model or self.model)(
            mb.input_ids[None],
            mb.position_ids[1:, None, :],  # the M-RoPE rows (t, h, w)
            pixel_values=mb.pixel_values,
            image_grid_thw=mb.image_grid_thw,
            packed_seq_params=packed,
            image_positions=mb.image_positions,
            vision_inputs=mb.vision_inputs,
            logit_rows=None if positions is None else positions - 1,
        )[0]  # [T or R, V / tp]: this rank's slice of the vocabulary
        temperature = self.config.temperature
        if positions is None:
            if self.tp_size == 1:
                lp = aligned_logprobs(logits, mb.input_ids, mb.cu_seqlens, temperature)
            else:
                lp = _vocab_parallel_aligned_logprobs(
                    logits, mb.input_ids, mb.cu_seqlens, temperature
                )
            return lp[: mb.num_real_tokens]
        targets = mb.input_ids[positions]
        if self.tp_size == 1:
            rows = logprobs_from_logits(logits, targets, temperature)
        else:  # vocabulary-parallel: the full-vocabulary logits are never gathered
            scaled = logits.float() / temperature
            rows = -tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None], targets[:, None])
            rows = rows[:, 0]
        return scatter_rows(rows, positions, mb.input_ids.shape[0])[: mb.num_real_tokens]

    # ----------------------------------------------------------------------------- protocol
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample log-probs ``[L_i]`` (float32, CPU) of this rank's samples, under the
        policy or (``reference=True``) the frozen initial weights."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("reference=True needs MegatronConfig(reference_model=True)")
        self._require_onloaded()
        batch = self._group_batch(batch)
        model.eval()
        return collect_logprobs(
            self.micro_batches(batch), lambda mb: self._logprobs(mb, model), len(batch)
        )

    def _loss(self, loss: str | TrainLoss) -> TrainLoss:
        cfg = self.config
        return resolve_loss(loss, grpo=cfg.grpo, sft_agg_mode=cfg.sft_loss_agg_mode)

    def train_step(self, batch: TrainBatch, *, loss: str | TrainLoss = "grpo") -> dict[str, float]:
        """One optimizer step over the global batch (this rank's part), the step of
        :mod:`rl_algos.train_step` over this actor's hooks; metrics are global."""
        self._require_onloaded()
        return core.train_step(self, self._group_batch(batch), self._loss(loss))

    def forward_backward(
        self, batch: TrainBatch, *, loss: str | TrainLoss = "grpo"
    ) -> dict[str, float]:
        """Accumulate the gradient of the global-batch loss; no optimizer step."""
        self._require_onloaded()
        return core.forward_backward(self, self._group_batch(batch), self._loss(loss))

    def optimizer_step(self) -> dict[str, float]:
        """Reduce and clip the gradients, step AdamW and the LR schedule (skipped for a
        non-finite gradient norm, reported as ``update_skipped``)."""
        return core.optimizer_step(self)

    # ------------------------------------------------------------ the trainer step's hooks
    @property
    def group(self) -> Any:
        """The step's samples are split over the data-parallel ranks (TP peers share them)."""
        return self.dp_group

    def run_micro_batches(
        self, micro_batches: MicroBatches, loss_fn: MicroBatchLoss, *, entropy: EntropyMode
    ) -> None:
        """Forward, loss and backward, one micro-batch after the other (no entropy: the
        vocabulary-parallel entropy is not written yet). A pipeline schedule (megatron-core's
        ``get_forward_backward_func``) would take ``loss_fn`` as its per-micro-batch loss."""
        if entropy == "grad":
            raise ValueError("the Megatron actor has no entropy bonus (grpo.entropy_coef)")
        self.model.train()
        run_sequentially(
            micro_batches, lambda mb: (self._logprobs(mb), None), Tensor.backward, loss_fn
        )

    def finish_grads(self) -> Tensor:
        """Finish the gradients (TP partial sums, DP sum); their global norm, on the device."""
        qk_norm = self.model.config.qk_layernorm
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            partial = getattr(p, "sequence_parallel", False) and self.config.sp
            partial = partial or (qk_norm and ("q_layernorm" in name or "k_layernorm" in name))
            if partial and self.tp_size > 1:
                dist.all_reduce(p.grad, group=self.tp_group)
            dist.all_reduce(p.grad, group=self.dp_group)
        # Norm: TP-sharded tensors count on every TP rank, replicated ones once.
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        square = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for p in self.params:
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                square += p.grad.double().pow(2).sum()
        if self.tp_size > 1:
            dist.all_reduce(square, group=self.tp_group)
        return square.sqrt()

    def apply_update(self, grad_norm: float | None) -> float:
        """Clip to ``max_grad_norm`` and step (``None``: no update, the schedule stays);
        the gradients are dropped either way. Returns this step's LR."""
        if grad_norm is not None:
            max_norm = self.config.max_grad_norm
            if max_norm > 0 and grad_norm > max_norm:
                for p in self.params:
                    p.grad.mul_(max_norm / (grad_norm + 1e-6))
            self._optimizer_step()
        for p in self.params:
            p.grad = None
        return self.optimizer.param_groups[0]["lr"]

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        self.scheduler.step(1)  # this step's LR (the scheduler counts steps from 1)
        if self.masters is not self.params:
            for master, p in zip(self.masters, self.params, strict=True):
                master.grad = p.grad.float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            for master, p in zip(self.masters, self.params, strict=True):
                p.copy_(master)

    # ----------------------------------------------------------------------------- weights
    def iter_hf_weights(
        self, bucket_bytes: int = 1 << 30, *, device: str | None = "cpu"
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Full HF-named tensors (``export_dtype``, on ``device``; None: the weights' own) in
        buckets; collective over TP."""
        self._require_onloaded()
        dtype = getattr(torch, self.config.export_dtype)
        for bucket in iter_hf_weights(self.model, bucket_bytes):
            yield [(n, t.to(device=device, dtype=dtype)) for n, t in bucket]

    def export_hf(self, path: str | os.PathLike) -> None:
        """An HF folder (config + safetensors) that ``from_pretrained`` loads; rank 0 writes."""
        path = Path(path)
        tensors: dict[str, Tensor] = {}
        for bucket in self.iter_hf_weights():
            if self.rank == 0:
                tensors.update(bucket)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self.hf_config.save_pretrained(path)
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Each rank's shard, master weights, optimizer state and step (same layout to resume)."""
        self._require_onloaded()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "masters": None if self.masters is self.params else [m.detach() for m in self.masters],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
        }
        torch.save(state, path / f"rank{self.rank:05d}.pt")
        if self.rank == 0:
            meta = {"world_size": dist.get_world_size(), "tp": self.config.tp, "sp": self.config.sp}
            (path / "actor.json").write_text(json.dumps(meta) + "\n")
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from :meth:`save_checkpoint`'s folder (same world size and TP)."""
        self._require_onloaded()
        path = Path(path)
        meta = json.loads((path / "actor.json").read_text())
        if (meta["world_size"], meta["tp"]) != (dist.get_world_size(), self.config.tp):
            raise ValueError(f"{path} was saved with {meta}; this run has tp={self.config.tp}")
        state = torch.load(path / f"rank{self.rank:05d}.pt", weights_only=True)  # no code runs
        self.model.load_state_dict(state["model"], strict=False)
        if state["masters"] is not None:
            with torch.no_grad():
                for master, saved in zip(self.masters, state["masters"], strict=True):
                    master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])

    # ----------------------------------------------------------------------------- offload
    def offload(self) -> None:
        """Move parameters, master weights and optimizer state to CPU (frees the GPU)."""
        self._move(torch.device("cpu"))
        self._offloaded = self.device.type != "cpu"

    def onload(self) -> None:
        """Bring back everything :meth:`offload` moved."""
        self._move(self.device)
        self._offloaded = False

    def release_cache(self) -> None:
        """Give the allocator's cached, unused blocks back to the device (a colocated engine
        resumes next); the model and optimizer state stay where they are."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            logger.info(
                "released %.1f GiB of cached GPU memory (%.1f GiB stays allocated)",
                (before - torch.cuda.memory_reserved()) / 2**30,
                torch.cuda.memory_allocated() / 2**30,
            )

    def _move(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        with torch.no_grad():
            self.model.to(device)  # parameters and buffers (rotary tables, vision embeddings)
            if self.ref_model is not None:
                self.ref_model.to(device)
            for t in {id(x): x for x in [*self.params, *self.masters]}.values():
                t.data = t.data.to(device)
                if t.grad is not None:
                    t.grad = t.grad.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, Tensor):
                    state[k] = v.to(device)
        if device.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            _report_leftovers()

    def _require_onloaded(self) -> None:
        if self._offloaded:
            raise RuntimeError("the actor is offloaded: call onload() first")


def _report_leftovers(threshold: int = 1 << 30) -> None:
    """Warn, naming the largest live CUDA tensors, when an offload leaves memory behind: a
    colocated engine needs it back, and the tensors' shapes say which reference still holds it."""
    allocated = torch.cuda.memory_allocated()
    if allocated < threshold:
        return
    import gc

    live = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, Tensor) and obj.is_cuda:
                live[obj.untyped_storage().data_ptr()] = obj
        except Exception:  # gc holds objects that refuse inspection
            continue
    largest = sorted(live.values(), key=lambda t: t.untyped_storage().nbytes(), reverse=True)
    described = ", ".join(
        f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB"
        for t in largest[:8]
    )
    logger.warning(
        "offload left %.1f GiB allocated on the GPU (reserved %.1f GiB); largest live tensors: %s",
        allocated / 2**30,
        torch.cuda.memory_reserved() / 2**30,
        described or "none reachable from Python",
    )
