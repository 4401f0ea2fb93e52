"""The FSDP2 actor: log-probs, GRPO / SFT optimizer steps, weight export, checkpoints, offload.

It implements the trainer protocol of ``docs/architecture.md``. One actor runs in each rank's
process; every method is collective (all ranks call it, each with its own part of the batch).
The model is a plain transformers model (``vlm_models.build_model``) with parallelism applied
by :mod:`trainers_fsdp.parallelize`. In a world of one there is nothing to shard: the model
trains directly, in bf16 over float32 master weights (:mod:`trainers_fsdp.master`), unless
``FsdpConfig.shard_single_rank`` asks for FSDP anyway. ``FsdpConfig.replicate`` trains that way
on several ranks too, averaging the gradients with one all-reduce (data parallel without
sharding, for models that fit on one GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from rl_algos import (
    TrainBatch,
    aligned_entropy,
    aligned_logprobs,
    entropy_from_logits,
    grpo_loss,
    logprobs_from_logits,
    loss_denominator,
    sft_loss,
)
from trainers_fsdp.attention import PACKED_ATTENTION, PackedSeqInfo, register_packed_attention
from trainers_fsdp.checkpoint import load_checkpoint, save_checkpoint
from trainers_fsdp.config import FsdpConfig
from trainers_fsdp.distributed import (
    all_reduce_,
    all_reduce_mean_,
    build_mesh,
    init_distributed,
    resolve_device,
)
from trainers_fsdp.flat_adamw import FlatAdamW, move_optimizer_state
from trainers_fsdp.fused import fuse_rms_norms
from trainers_fsdp.master import MasterWeights
from trainers_fsdp.microbatch import (
    MicroBatch,
    PinnedStaging,
    build_micro_batch,
    plan_micro_batches,
)
from trainers_fsdp.optim import (
    build_optimizer,
    build_scheduler,
    clip_coefficient,
    grad_norm,
    step_with_scaled_grads,
)
from trainers_fsdp.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    compile_by_default,
    mixed_precision_policy,
)
from trainers_fsdp.vision import VisionInputs, fuse_vision_attention
from trainers_fsdp.weights import export_hf_folder, iter_hf_weight_buckets
from vlm_models import (
    build_model,
    has_linear_attention,
    pack_linear_attention,
    remove_host_syncs,
    supports_packed_forward,
)

logger = logging.getLogger(__name__)

LOSSES = ("grpo", "sft")


@dataclasses.dataclass
class _Pending:
    """A step's metrics reduced over ranks but not yet read from the device."""

    mean_keys: list[str]
    ext_keys: list[str]
    mean_vec: Tensor  # token-weighted sums, then total weight, loss, tokens (float64)
    ext_vec: Tensor  # maxima (minima negated), then a 0 pad
    num_micro_batches: float = 0.0


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


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
        self.rank, self.world_size = init_distributed(self.device, timeout_s=config.dist_timeout_s)
        self.mesh = build_mesh(self.device)
        default_dtype = "bfloat16" if self.device.type == "cuda" else None
        self.param_dtype = _dtype(config.param_dtype or default_dtype)
        self.compile = config.compile  # None: decided by the model built (compile_by_default)
        self._vision_inputs: dict[int, VisionInputs | None] = {}  # by id(model)
        self._masters: MasterWeights | None = None  # one rank, low-precision compute
        # reused pinned host buffers: each micro-batch reaches the GPU in one copy (PinnedStaging)
        self._staging = PinnedStaging() if self.device.type == "cuda" else None
        self.model = self._build(trainable=True)
        self.ref_model = self._build(trainable=False) if config.reference_model else None
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
        self.optimizer = build_optimizer(self._trained, config.optim, self.device, self._masters)
        self.scheduler = build_scheduler(self.optimizer, config.optim)
        self.step = 0
        self._offloaded = False
        self._grads_averaged = True  # replicate: nothing accumulated since the last average
        torch.manual_seed(config.seed + self.rank)

    # ----------------------------------------------------------------------------- building
    def _build(self, *, trainable: bool) -> nn.Module:
        cfg = self.config
        if cfg.attn_implementation == PACKED_ATTENTION:
            register_packed_attention()
        torch.manual_seed(cfg.seed)  # identical init on every rank before sharding
        model = build_model(
            cfg.model,
            dtype=torch.float32,
            attn_implementation=cfg.attn_implementation,
            vision_attn_implementation=cfg.vision_attn_implementation,
            freeze_vision=cfg.freeze_vision,
            **cfg.model_overrides,
        )
        model.config.use_cache = False
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        if cfg.fused_rms_norm:
            fuse_rms_norms(model)
        if cfg.fused_vision_attention:
            fuse_vision_attention(model)
        remove_host_syncs(model)  # counts are checked on the host, in build_micro_batch
        pack_linear_attention(model)  # Qwen3.5: recurrent state reset at sample boundaries
        self._vision_inputs[id(model)] = VisionInputs.attach(model)
        if trainable and cfg.activation_checkpointing:
            apply_ac(model)
        offload = not trainable and cfg.offload_reference and self.device.type == "cuda"
        if self.compile is None:
            self.compile = compile_by_default(self.device, model.config)
        # An offloaded reference copies each unit's weights in as it runs, so compiling it
        # gains little, and FSDP's offload hooks inside compiled calls were never measured.
        if self.compile and not offload:
            apply_compile(model)
        whole = self.world_size == 1 or cfg.replicate  # every rank holds the whole model
        if whole and not offload and not cfg.shard_single_rank:
            return self._place_single_rank(model, trainable=trainable)
        mp = mixed_precision_policy(self.param_dtype, _dtype(cfg.reduce_dtype))
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
            self._masters = MasterWeights(model, compute, self.device)
        else:
            for p in model.parameters():
                p.data = p.data.to(self.device, compute)
        return model.to(self.device)

    @property
    def _trained(self) -> nn.Module:
        """The module whose parameters the optimizer steps and checkpoints hold: the float32
        masters of a one-rank bf16 actor, else the (FSDP) model itself."""
        return self.model if self._masters is None else self._masters.module

    @property
    def model_config(self):
        return self.model.config

    # ----------------------------------------------------------------------------- forward
    def _micro_batches(self, batch: TrainBatch, model: nn.Module) -> Iterator[MicroBatch]:
        plan = plan_micro_batches(
            batch.lengths,
            self.config.max_tokens_per_gpu,
            one_per_micro_batch=self._one_per_micro_batch,
        )
        need_vision = self.world_size > 1
        vision = self._vision_inputs.get(id(model))
        for indices in plan:
            with record_function("fsdp_actor.micro_batch"):  # host work the GPU may wait on
                mb = build_micro_batch(batch, indices, self.model_config, need_vision=need_vision)
                if vision is not None and mb.image_grid_thw is not None:
                    mb.vision_inputs = vision.compute(mb.image_grid_thw)
                mb = mb.to(self.device, self._staging)
            yield mb

    def _forward(
        self, model: nn.Module, mb: MicroBatch, *, entropy: str | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Packed forward; aligned log-probs ``[T]`` (float32) and optionally entropy ``[T]``.

        With ``logprobs_scope="loss"`` the LM head runs only on the rows that predict loss
        tokens (``logits_to_keep``), and other positions hold 0, which the token alignment
        convention allows. ``entropy``: None, ``"grad"`` (differentiable, for an entropy bonus)
        or ``"metric"`` (detached).
        """
        kwargs = dict(
            input_ids=mb.input_ids[None],
            position_ids=mb.position_ids[:, None, :],
            use_cache=False,
        )
        if mb.pixel_values is not None:
            kwargs["pixel_values"] = mb.pixel_values
            kwargs["image_grid_thw"] = mb.image_grid_thw
        if self.config.attn_implementation == PACKED_ATTENTION or self._linear_attention:
            kwargs["packed_seq_info"] = PackedSeqInfo(
                mb.cu_seqlens, tuple(mb.lengths), max(mb.lengths)
            )
        vision = self._vision_inputs.get(id(model))
        injected = nullcontext() if vision is None else vision.use(mb.vision_inputs)
        with record_function("fsdp_actor.forward"), injected:
            return self._scored_forward(model, mb, kwargs, entropy)

    def _scored_forward(
        self, model: nn.Module, mb: MicroBatch, kwargs: dict, entropy: str | None
    ) -> tuple[Tensor, Tensor | None]:
        """The model call and the log-prob (and entropy) rows of :meth:`_forward`."""
        temperature = self.config.temperature
        total = mb.input_ids.shape[0]
        if self.config.logprobs_scope == "all":
            logits = model(**kwargs).logits[0]
            cu = [0]
            for n in mb.lengths:
                cu.append(cu[-1] + n)
            logprobs = aligned_logprobs(logits, mb.input_ids, cu, temperature)
            ent = None
            if entropy == "grad":
                ent = aligned_entropy(logits, cu, temperature)
            elif entropy == "metric":
                with torch.no_grad():
                    ent = aligned_entropy(logits.detach(), cu, temperature)
            return logprobs, ent

        positions = mb.loss_positions  # tokens whose log-prob is needed
        if positions.numel() == 0:  # nothing to score (dummy row): keep the graph, cheaply
            logits = model(**kwargs, logits_to_keep=1).logits[0]
            zero = logits.sum().float() * 0.0
            return torch.zeros(total, device=logits.device) + zero, None
        logits = model(**kwargs, logits_to_keep=positions - 1).logits[0]  # [R, V]
        compiled = self.compile
        rows = logprobs_from_logits(logits, mb.input_ids[positions], temperature, compiled=compiled)
        logprobs = torch.zeros(total, device=rows.device, dtype=rows.dtype)
        logprobs = logprobs.index_copy(0, positions, rows)
        ent = None
        if entropy is not None:
            with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                src = logits if entropy == "grad" else logits.detach()
                ent_rows = entropy_from_logits(src, temperature, compiled=compiled)
                ent = torch.zeros_like(logprobs).index_copy(0, positions, ent_rows)
        return logprobs, ent

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample log-probs ``[L_i]`` (float32, CPU) under the policy or the reference."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("reference=True needs FsdpConfig(reference_model=True)")
        self._require_onloaded()
        was_training = model.training
        model.eval()
        out: list[Tensor | None] = [None] * len(batch)
        for mb in self._micro_batches(batch, model):
            logprobs, _ = self._forward(model, mb)
            logprobs = logprobs.float().cpu()
            start = 0
            for i, n in zip(mb.indices, mb.lengths, strict=False):
                out[i] = logprobs[start : start + n]
                start += n
        model.train(was_training)
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- training
    def _loss_settings(self, batch: TrainBatch, loss: str) -> tuple[str, float | None]:
        """Aggregation mode and the norm length fixed over the global batch."""
        if loss == "grpo":
            mode, norm = self.config.grpo.loss_agg_mode, self.config.grpo.norm_length
        else:
            mode, norm = self.config.sft_loss_agg_mode, None
        if mode == "seq-mean-token-sum-norm" and norm is None:
            longest = max([int((m > 0).sum()) for m in batch.loss_mask] or [0])
            t = all_reduce_(torch.tensor([float(longest)]), dist.ReduceOp.MAX)
            norm = max(1.0, float(t.item()))
        return mode, norm

    def _check_batch(self, batch: TrainBatch, loss: str) -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if loss == "grpo" and len(batch) and batch.advantages is None:
            raise ValueError("train_step(loss='grpo') needs batch.advantages")
        if loss == "grpo" and self.config.grpo.kl_coef and batch.ref_logprobs is None:
            raise ValueError(
                "grpo kl_coef > 0 needs batch.ref_logprobs (compute_logprobs(batch, reference=True))"
            )

    def train_step(self, batch: TrainBatch, *, loss: str = "grpo") -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's part of the global batch).

        :meth:`forward_backward` then :meth:`optimizer_step`; returns their metrics together
        with ``tokens`` (global), ``step_time_s`` and ``tokens_per_s``. The host reads the
        device once: the metrics and the gradient norm in one transfer, before the update. The
        update is then queued without waiting for it, so whatever the host does next (the next
        batch's packing, the next forward's launches) overlaps the optimizer on the GPU.
        """
        start = time.perf_counter()
        pending = self._accumulate(batch, loss)
        values = self._read(pending, extra=[self._grad_norm()])
        grad_norm = values.pop("_extra_0")
        out = {**values, **self._update(grad_norm)}
        elapsed = time.perf_counter() - start
        out.update(step_time_s=elapsed, tokens_per_s=out["tokens"] / elapsed)
        return out

    def forward_backward(self, batch: TrainBatch, *, loss: str = "grpo") -> dict[str, float]:
        """Accumulate the gradient of the global-batch loss; no optimizer step.

        Micro-batches are packed to ``max_tokens_per_gpu``; each micro-batch loss is scaled so
        the accumulated gradient equals that of the loss aggregated over the whole global batch
        (all micro-batches of all ranks) under the configured aggregation mode: token-mean
        divides by the global count of loss tokens, the sequence modes by the global count of
        samples.
        """
        return self._read(self._accumulate(batch, loss))

    def _accumulate(self, batch: TrainBatch, loss: str) -> _Pending:
        """:meth:`forward_backward` up to the reduced metrics, left on the device."""
        self._check_batch(batch, loss)
        self._require_onloaded()
        cfg = self.config
        mode, norm = self._loss_settings(batch, loss)
        grpo_cfg = dataclasses.replace(cfg.grpo, loss_agg_mode=mode, norm_length=norm)
        local_units = loss_denominator(batch.loss_mask, mode)
        global_units = float(all_reduce_(torch.tensor([local_units], dtype=torch.float64)).item())
        entropy_mode = None
        if loss == "grpo" and cfg.grpo.entropy_coef:
            entropy_mode = "grad"
        elif cfg.log_entropy:
            entropy_mode = "metric"

        self.model.train()
        sums: dict[str, Tensor] = {}
        weights = 0.0
        loss_total = torch.zeros((), device=self.device, dtype=torch.float64)
        n_micro = 0
        for mb in self._micro_batches(batch, self.model):
            n_micro += 1
            logprobs, ent = self._forward(self.model, mb, entropy=entropy_mode)
            if not mb.indices:  # dummy row: run forward/backward for the collectives only
                self._backward(logprobs.sum() * 0.0)
                continue
            with record_function("fsdp_actor.loss"):
                value, metrics = self._micro_loss(loss, mb, logprobs, ent, grpo_cfg, mode, norm)
            scale = mb.loss_units[mode] / global_units if global_units > 0 else 0.0
            # FSDP averages gradients over ranks; multiplying by world size makes it a sum.
            self._backward(value * (scale * self.world_size))
            loss_total += value.detach().double() * scale
            tokens = float(mb.loss_units["token-mean"])
            weights += tokens
            for k, v in metrics.items():
                if k == "loss":
                    continue
                v = v.detach().double()
                if k.endswith(("_max", "_min")):
                    v = v if k.endswith("_max") else -v
                    sums[k] = v if k not in sums else torch.maximum(sums[k], v)
                else:
                    sums[k] = sums.get(k, 0.0) + v * tokens
        pending = self._reduce_metrics(sums, weights, loss_total, float(batch.num_tokens))
        pending.num_micro_batches = float(n_micro)
        return pending

    def _backward(self, loss: Tensor) -> None:
        """``loss.backward()``; with one-rank master weights, the bf16 gradient buffer is first
        emptied into the float32 one, so micro-batches sum in float32."""
        if self._masters is not None:
            self._masters.before_backward()
        with record_function("fsdp_actor.backward"):
            loss.backward()
        self._grads_averaged = False

    def _micro_loss(
        self,
        loss: str,
        mb: MicroBatch,
        logprobs: Tensor,
        ent: Tensor | None,
        grpo_cfg,
        mode: str,
        norm: float | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's loss (before the global-batch scale) and its metrics."""
        n_real = mb.num_real_tokens
        lp = logprobs[:n_real]
        f = mb.fields
        cu = mb.real_cu_seqlens
        mask = f["loss_mask"]
        if loss == "grpo":
            return grpo_loss(
                lp,
                old_logprobs=f.get("old_logprobs", lp.detach()),
                advantages=f["advantages"],
                loss_mask=mask,
                cu_seqlens=cu,
                config=grpo_cfg,
                ref_logprobs=f.get("ref_logprobs"),
                rollout_logprobs=f.get("rollout_logprobs"),
                entropy=None if ent is None else ent[:n_real],
            )
        value = sft_loss(lp, mask, cu, mode, norm_length=norm)
        metrics = {"loss": value.detach()}
        if ent is not None:
            on = (mask > 0).to(ent.dtype)
            metrics["entropy"] = (ent[:n_real] * on).sum() / on.sum().clamp(min=1)
        return value, metrics

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step AdamW and the LR schedule, zero the gradients. A non-finite gradient
        norm skips the update (reported as ``update_skipped``)."""
        return self._update(float(self._grad_norm()))

    def _average_grads(self) -> None:
        """Replicated ranks (``FsdpConfig.replicate``): average the accumulated gradients over
        ranks before anything reads them (FSDP reduces inside its backward instead). Averaging
        again after more backwards is still right: the averaged part is the same everywhere."""
        if self._grads_averaged or not self.config.replicate or self.world_size == 1:
            return
        with record_function("fsdp_actor.all_reduce"):
            if self._masters is not None:
                self._masters.all_reduce_grads(_dtype(self.config.reduce_dtype))
            else:  # float32 compute: one all-reduce over the gradients laid end to end
                params = [p for p in self.model.parameters() if p.requires_grad]
                grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
                flat = all_reduce_mean_(torch.cat([g.reshape(-1) for g in grads]))
                parts = flat.split([g.numel() for g in grads])
                for p, g, part in zip(params, grads, parts, strict=True):
                    p.grad = g.copy_(part.view_as(g))
        self._grads_averaged = True

    def _grad_norm(self) -> Tensor:
        """The global norm of the accumulated gradients, on the device."""
        self._average_grads()
        with record_function("fsdp_actor.grad_norm"):
            if isinstance(self.optimizer, FlatAdamW):  # the master weights' own buffers
                return self.optimizer.grad_norm()
            return grad_norm(self._trained.parameters())

    def _update(self, grad_norm: float) -> dict[str, float]:
        """Clip and step (skipped for a non-finite norm), zero the gradients, then the LR
        schedule, step count and the step's metrics. Nothing here waits for the GPU."""
        skipped = not math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        with record_function("fsdp_actor.optimizer"):
            if not skipped:
                coef = clip_coefficient(grad_norm, self.config.optim.max_grad_norm)
                step_with_scaled_grads(self.optimizer, coef)
            self.zero_grad()
        if skipped:
            logger.warning("step %d: non-finite grad norm %s, update skipped", self.step, grad_norm)
        else:
            self.scheduler.step()
        self.step += 1
        return {
            "grad_norm": grad_norm,
            "lr": lr,
            "step": float(self.step),
            "update_skipped": float(skipped),
        }

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

    def _reduce_metrics(
        self, sums: dict[str, Tensor], weights: float, loss_total: Tensor, tokens: float
    ) -> _Pending:
        """Token-weighted sums (max / min for ``*_max`` / ``*_min``) reduced over all ranks,
        still on the device: :meth:`_read` turns them into means with one host transfer."""
        keys = sorted(sums)
        if self.world_size > 1:
            gathered: list[list[str]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(gathered, keys)
            keys = sorted(set().union(*gathered))
        mean_keys = [k for k in keys if not (k.endswith("_max") or k.endswith("_min"))]
        ext_keys = [k for k in keys if k not in mean_keys]

        # Host numbers enter as fills (kernels with a scalar argument): torch.tensor(x,
        # device=...) would be a copy from pageable memory, which waits for the GPU.
        def fill(value: float) -> Tensor:
            return torch.full((), value, dtype=torch.float64, device=self.device)

        def on_device(key: str, default: float) -> Tensor:
            return sums[key].to(self.device, torch.float64) if key in sums else fill(default)

        mean_vec = torch.stack(
            [on_device(k, 0.0) for k in mean_keys]
            + [fill(weights), loss_total.to(self.device), fill(tokens)]
        )
        all_reduce_(mean_vec)
        ext_vec = torch.stack([on_device(k, -float("inf")) for k in ext_keys] + [fill(0.0)])
        all_reduce_(ext_vec, dist.ReduceOp.MAX)
        return _Pending(mean_keys, ext_keys, mean_vec, ext_vec)

    def _read(self, pending: _Pending, extra: list[Tensor] = ()) -> dict[str, float]:
        """The metrics of :meth:`_reduce_metrics` (plus ``extra`` scalars as ``_extra_<i>``),
        read from the device in one transfer: the step's single host sync."""
        dev = pending.mean_vec.device
        parts = [pending.mean_vec, pending.ext_vec]
        parts += [torch.as_tensor(e).to(dev, torch.float64).reshape(1) for e in extra]
        values = torch.cat(parts).tolist()
        n_mean = len(pending.mean_keys)
        mean_vals, rest = values[: n_mean + 3], values[n_mean + 3 :]
        total_w, loss_value, tokens = mean_vals[-3:]
        out = {
            k: v / total_w if total_w > 0 else 0.0
            for k, v in zip(pending.mean_keys, mean_vals, strict=False)
        }
        for k, v in zip(pending.ext_keys, rest, strict=False):
            out[k] = v if k.endswith("_max") else -v
        for i, v in enumerate(rest[len(pending.ext_keys) + 1 :]):
            out[f"_extra_{i}"] = v
        out.update(
            loss=loss_value,
            tokens=tokens,
            loss_tokens=total_w,
            num_micro_batches=pending.num_micro_batches,
        )
        return out

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
        dtype = _dtype(self.config.export_dtype)
        yield from iter_hf_weight_buckets(
            self.model, bucket_bytes, dtype, device=device, state=self._master_state()
        )

    def export_hf(self, path: str | os.PathLike, *, dtype: str | None = None) -> None:
        """Write an HF folder that ``Qwen3VLForConditionalGeneration.from_pretrained`` loads."""
        self._require_onloaded()
        export_hf_folder(
            self.model,
            path,
            dtype=_dtype(dtype or self.config.export_dtype),
            state=self._master_state(),
        )

    def _master_state(self) -> dict[str, Tensor] | None:
        """What weight export reads instead of the model's state dict: the float32 masters."""
        return None if self._masters is None else self._masters.state_dict()

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
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU (frees the GPU for rollout)."""
        self._move(torch.device("cpu"))
        self._offloaded = self.device.type != "cpu"

    def onload(self) -> None:
        """Bring everything :meth:`offload` moved back to the GPU."""
        self._move(self.device)
        self._offloaded = False

    def release_cache(self) -> None:
        """Give the allocator's cached, unused blocks back to the device (a colocated engine
        resumes next); the model and optimizer state stay where they are."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _move(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        if self._masters is not None:  # the flat buffers first: model.to then keeps the views
            self._masters.to(device, fill=device.type != "cpu")
        self.model.to(device)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad = p.grad.to(device)
        move_optimizer_state(self.optimizer, device)
        if device.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        logger.info("actor state moved to %s", device)

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
