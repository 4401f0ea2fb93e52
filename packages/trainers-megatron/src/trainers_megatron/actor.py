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
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from safetensors.torch import save_file
from torch import Tensor

from rl_algos import (
    TrainBatch,
    aligned_logprobs,
    grpo_loss,
    logprobs_from_logits,
    loss_denominator,
    pack_by_token_budget,
    sft_loss,
)
from trainers_megatron.config import MegatronConfig
from vlm_models import (
    PRESETS,
    build_model,
    packed_position_ids,
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

LOSSES = ("grpo", "sft")
_TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclasses.dataclass
class MicroBatch:
    """Samples packed end to end, padded (as one extra sample) to a multiple of TP under SP."""

    indices: list[int]
    lengths: list[int]
    input_ids: Tensor  # [T]
    position_ids: Tensor  # [3, T]
    cu_seqlens: Tensor  # int32 [n (+1) + 1]
    pixel_values: Tensor | None
    image_grid_thw: Tensor | None  # on the host when vision_inputs are given
    fields: dict[str, Tensor]  # packed per-token fields of the real samples
    max_seqlen: int = 0  # the longest packed sample, known on the host
    image_positions: Tensor | None = None  # flat indices of the image tokens, from the host
    vision_inputs: dict | None = None  # the tower's inputs (vlm_models.VisionInputs)
    loss_positions: Tensor | None = None  # tokens whose log-prob the loss needs (on device)

    @property
    def num_real(self) -> int:
        return sum(self.lengths)

    @property
    def real_cu(self) -> list[int]:
        return self.cu_seqlens[: len(self.lengths) + 1].tolist()


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


def _to(inputs: dict, device: torch.device) -> dict:
    """The tensors of a dict on ``device``; other values as they are."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}


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

    def _micro_batches(self, batch: TrainBatch) -> Iterator[MicroBatch]:
        grids_all = batch.image_grid_thw or [None] * len(batch)
        pixels_all = batch.pixel_values or [None] * len(batch)
        for indices in pack_by_token_budget(batch.lengths, self.config.max_tokens_per_gpu):
            ids = [batch.input_ids[i] for i in indices]
            grids = [grids_all[i] for i in indices]
            lengths = [len(t) for t in ids]
            positions = packed_position_ids(ids, grids, self.hf_config)
            flat = torch.cat(ids)
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            pad = -len(flat) % self.tp_size if self.config.sp else 0
            if pad:  # one padding sample, so every SP rank gets an equal slice
                flat = torch.cat([flat, flat.new_zeros(pad)])
                positions = torch.cat([positions, torch.arange(pad).expand(3, -1)], dim=1)
                cu.append(cu[-1] + pad)
            with_images = [i for i in indices if grids_all[i] is not None and len(grids_all[i])]
            fields = {
                name: torch.cat([getattr(batch, name)[i] for i in indices]).float().to(self.device)
                for name in _TOKEN_FIELDS
                if getattr(batch, name) is not None
            }
            masks = torch.cat([batch.loss_mask[i] for i in indices])
            loss_positions = masks.nonzero()[:, 0].to(self.device)  # host mask, no device sync
            grid = image_positions = vision_inputs = None
            if with_images:
                grid = torch.cat([grids_all[i] for i in with_images])
                image_positions = (flat == self.hf_config.image_token_id).nonzero()[:, 0]
                image_positions = image_positions.to(self.device)
                vision = self.model.vision_inputs
                if vision is None:  # the tower computes its inputs from a device grid
                    grid = grid.to(self.device)
                else:  # computed here; the grid stays on the host, read there as a list
                    vision_inputs = _to(vision.compute(grid), self.device)
            yield MicroBatch(
                indices=indices,
                lengths=lengths,
                input_ids=flat.to(self.device),
                position_ids=positions.to(self.device),
                cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=self.device),
                pixel_values=(
                    torch.cat([pixels_all[i] for i in with_images]).to(self.device)
                    if with_images
                    else None
                ),
                image_grid_thw=grid,
                fields=fields,
                max_seqlen=max(b - a for a, b in itertools.pairwise(cu)),
                image_positions=image_positions,
                vision_inputs=vision_inputs,
                loss_positions=loss_positions,
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
            mb.position_ids[:, None, :],
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
            return lp[: mb.num_real]
        targets = mb.input_ids[positions]
        if self.tp_size == 1:
            rows = logprobs_from_logits(logits, targets, temperature)
        else:  # vocabulary-parallel: the full-vocabulary logits are never gathered
            scaled = logits.float() / temperature
            rows = -tensor_parallel.vocab_parallel_cross_entropy(scaled[:, None], targets[:, None])
            rows = rows[:, 0]
        lp = rows.new_zeros(mb.input_ids.shape[0]).index_copy(0, positions, rows)
        return lp[: mb.num_real]

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
        out: list[Tensor | None] = [None] * len(batch)
        for mb in self._micro_batches(batch):
            lp = self._logprobs(mb, model).cpu()
            for i, part in zip(mb.indices, lp.split(mb.lengths), strict=True):
                out[i] = part
        return out  # type: ignore[return-value]

    def train_step(self, batch: TrainBatch, *, loss: str = "grpo") -> dict[str, float]:
        """One optimizer step over the global batch (this rank's part); metrics are global."""
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if loss == "grpo" and batch.advantages is None:
            raise ValueError("train_step(loss='grpo') needs batch.advantages")
        self._require_onloaded()
        start = time.perf_counter()
        batch = self._group_batch(batch)
        cfg = self.config
        mode = cfg.grpo.loss_agg_mode if loss == "grpo" else cfg.sft_loss_agg_mode
        norm = cfg.grpo.norm_length if loss == "grpo" else None
        if mode == "seq-mean-token-sum-norm" and norm is None:
            longest = torch.tensor(
                [max([float((m > 0).sum()) for m in batch.loss_mask] or [0.0])], device=self.device
            )
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.dp_group)
            norm = max(1.0, float(longest))
        # (collectives on self.device: NCCL reduces CUDA tensors only)
        units = torch.tensor(
            [loss_denominator(batch.loss_mask, mode)], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(units, group=self.dp_group)
        denominator = max(float(units), 1.0)
        grpo_cfg = dataclasses.replace(cfg.grpo, loss_agg_mode=mode, norm_length=norm)

        self.model.train()
        sums: dict[str, float] = {}
        total = 0.0
        tokens = 0.0
        for mb in self._micro_batches(batch):
            lp = self._logprobs(mb)
            f = mb.fields
            if loss == "grpo":
                value, metrics = grpo_loss(
                    lp,
                    old_logprobs=f.get("old_logprobs", lp.detach()),
                    advantages=f["advantages"],
                    loss_mask=f["loss_mask"],
                    cu_seqlens=mb.real_cu,
                    config=grpo_cfg,
                    ref_logprobs=f.get("ref_logprobs"),
                    rollout_logprobs=f.get("rollout_logprobs"),
                    denominator=denominator,
                )
            else:
                value = sft_loss(
                    lp, f["loss_mask"], mb.real_cu, mode, norm_length=norm, denominator=denominator
                )
                metrics = {}
            value.backward()
            total += float(value.detach())
            n = float((f["loss_mask"] > 0).sum())
            tokens += n
            for k, v in metrics.items():
                if k != "loss" and not k.endswith(("_max", "_min")):
                    sums[k] = sums.get(k, 0.0) + float(v) * n
        grad_norm = self._reduce_and_clip()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("step %d: non-finite grad norm %s, update skipped", self.step, grad_norm)
        else:
            self._optimizer_step()
        for p in self.params:
            p.grad = None
        self.step += 1
        keys = sorted(sums)
        if dist.get_world_size(self.dp_group) > 1:  # a rank without samples has no metrics
            gathered: list[list[str]] = [[] for _ in range(dist.get_world_size(self.dp_group))]
            dist.all_gather_object(gathered, keys, group=self.dp_group)
            keys = sorted(set().union(*gathered))
        stats = torch.tensor(
            [total, tokens, *(sums.get(k, 0.0) for k in keys)],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(stats, group=self.dp_group)
        weight = max(float(stats[1]), 1.0)
        out = {k: float(v) / weight for k, v in zip(keys, stats[2:], strict=True)}
        elapsed = time.perf_counter() - start
        n_tokens = torch.tensor([float(batch.num_tokens)], device=self.device)
        dist.all_reduce(n_tokens, group=self.dp_group)
        out.update(
            loss=float(stats[0]),
            loss_tokens=float(stats[1]),
            grad_norm=grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
            step=float(self.step),
            update_skipped=float(skipped),
            tokens=float(n_tokens),
            step_time_s=elapsed,
            tokens_per_s=float(n_tokens) / elapsed,
        )
        return out

    def _reduce_and_clip(self) -> float:
        """Finish the gradients (TP partial sums, DP sum), return the global norm, clip."""
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
        grad_norm = float(square.sqrt())
        max_norm = self.config.max_grad_norm
        if max_norm > 0 and math.isfinite(grad_norm) and grad_norm > max_norm:
            for p in self.params:
                p.grad.mul_(max_norm / (grad_norm + 1e-6))
        return grad_norm

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
