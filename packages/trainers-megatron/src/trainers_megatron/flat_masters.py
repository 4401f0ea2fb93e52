"""The distributed optimizer's per-step bookkeeping on whole bucket shards instead of parameters.

megatron-core's ``DistributedOptimizer`` keeps one float32 master tensor per parameter shard
and, every step, walks all of them in Python: it hands each its gradient (a view of the DDP
gradient buffer, looked up through the parameter's range map), and after AdamW copies each
master back into the bf16 parameter buffer, one kernel per parameter. For Qwen3-VL-2B's 541
tensors the update's launch alone took 13-20 ms of host time a step on the H200, against
4-7 ms without that walk (2026-12-02, docs/benchmarks/2026-12-02-megatron-trainer.md), and
the GPU, done with the small copies, waited for the host.

:class:`FlatMasters` keeps megatron-core's optimizer, its range maps, groups, state dicts and
checkpoints as they are, and moves each bucket's masters into one float32 tensor laid out as
this rank's shard of that bucket (the same offsets as the gradient and parameter buffers, the
alignment padding included and left at zero). The masters become views of it, so that

* gradients are attached once as views of the gradient buffer (``zero_grad_buffer`` zeroes them);
* the masters reach the parameters in one cast-copy per bucket;
* clipping rides in torch's fused AdamW as its ``grad_scale`` (the unscale argument
  ``torch.amp.GradScaler`` passes), instead of a separate pass over the gradients.

The arithmetic is unchanged: the same AdamW over the same tensors, the same norm.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class FlatMasters:
    """One ``DistributedOptimizer``'s masters as bucket-shard tensors (see the module docstring).

    Build with :meth:`of`, which answers None where the layout does not allow it (another
    optimizer class, bf16 gradient buffers, precision-aware or FSDP modes); megatron-core's own
    per-parameter path then stays in use.
    """

    def __init__(self, opt) -> None:
        self.opt = opt
        # (master, its gradient: a view of the DDP gradient buffer), every master of opt
        self._grads: list[tuple[Tensor, Tensor]] = []
        # (this rank's shard of a bucket's bf16 parameters, the float32 masters laid out as it)
        self._copies: list[tuple[Tensor, Tensor]] = []
        flats: dict[tuple[int, int], Tensor] = {}
        pairs = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
        for model_group, main_group in pairs:
            for model_param, main in zip(model_group, main_group, strict=True):
                ranges = opt._get_model_param_range_map(model_param)
                local = ranges["gbuf_local"]  # within this rank's shard of the bucket
                key = opt.model_param_gbuf_map[model_param][::2]  # (buffer, bucket)
                flat = flats.get(key)
                if flat is None:
                    buffer_index, bucket_index = key
                    bucket = opt.buffers[buffer_index].buckets[bucket_index]
                    ranks = opt.buffers[buffer_index].data_parallel_world_size
                    size = bucket.grad_data.numel() // ranks
                    start = ranges["gbuf_world_in_bucket"].start - local.start
                    shard = bucket.param_data.view(-1)[start : start + size]
                    flat = flats[key] = torch.zeros(size, dtype=main.dtype, device=main.device)
                    self._copies.append((shard, flat))
                view = flat[local.start : local.end]
                view.copy_(main.detach().view(-1))
                main.data = view.view_as(main)  # the same tensor object the optimizer holds
                self._grads.append((main, self._grad_view(model_param, ranges)))
        pairs = zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True)
        for model_group, main_group in pairs:  # float32 parameters: the masters are their views
            for model_param, main in zip(model_group, main_group, strict=True):
                ranges = opt._get_model_param_range_map(model_param)
                self._grads.append((main, self._grad_view(model_param, ranges)))
        self.attach_grads()
        # the gradients megatron-core's norm counts (no shared or tensor-parallel duplicates)
        self.grads_for_norm = list(opt.get_main_grads_for_grad_norm())
        self._inner = opt.optimizer

    @staticmethod
    def _grad_view(model_param, ranges) -> Tensor:
        piece = ranges["param"]  # the shard's range within the parameter
        return model_param.main_grad.view(-1)[piece.start : piece.end]

    @classmethod
    def of(cls, opt) -> FlatMasters | None:
        """Flat masters for ``opt``, or None where its layout keeps megatron-core's path."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer:
            return None
        config, ddp_config = opt.config, opt.ddp_config
        if (
            config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or config.reuse_grad_buf_for_mxfp8_param_ag
            or ddp_config.use_megatron_fsdp
            or opt.grad_scaler is not None
        ):
            return None
        params = [p for group in opt.model_float16_groups + opt.model_fp32_groups for p in group]
        if any(p.main_grad.dtype != torch.float32 for p in params):
            return None  # a bf16 gradient buffer: megatron-core casts a float32 copy each step
        return cls(opt)

    def attach_grads(self) -> None:
        """Give each master its gradient view (megatron-core's ``zero_grad`` drops them)."""
        for main, grad in self._grads:
            main.grad = grad

    @torch.no_grad()
    def step(self, clip_coeff: float | None) -> None:
        """AdamW on the masters with the gradients times ``clip_coeff`` (None: as they are),
        the masters into the parameter buffer, then megatron-core's parameter all-gather."""
        opt = self.opt
        # torch's fused Adam/AdamW divides the gradients by ``grad_scale`` as it reads them
        # (torch/optim/adam.py, ``_fused_adam``); other optimizers get a separate multiply
        groups = self._inner.param_groups
        fused = isinstance(self._inner, torch.optim.Adam) and all(g.get("fused") for g in groups)
        if clip_coeff is not None and not fused:
            torch._foreach_mul_([g for _, g in self._grads], clip_coeff)
            clip_coeff = None
        if clip_coeff is not None:
            device = self._copies[0][1].device if self._copies else self._grads[0][1].device
            self._inner.grad_scale = torch.full((), 1.0 / clip_coeff, device=device)
        try:
            opt.optimizer.step()
        finally:
            if clip_coeff is not None:
                self._inner.grad_scale = None
        for shard, flat in self._copies:
            shard.copy_(flat)
        if not opt.ddp_config.overlap_param_gather:
            for chunk in opt.model_chunks:
                chunk.start_param_sync()

    def tensors(self) -> Iterator[Tensor]:
        """The flat master tensors (for tests and memory accounting)."""
        return (flat for _, flat in self._copies)
