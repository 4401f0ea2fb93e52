"""MoE experts as two grouped GEMMs (``torch._grouped_mm``), without Transformer Engine.

megatron-core 0.16.1 computes grouped experts only through Transformer Engine
(``TEGroupedMLP``) or the ``grouped_gemm`` package (``GroupedMLP``); without either its local
spec runs ``SequentialMLP``, which splits the dispatched tokens by expert and runs each
expert's two matmuls on its own: 2 x 128 small GEMMs per MoE layer for Qwen3-VL-30B-A3B, each
under-filling the GPU, plus as many kernel launches in the backward. On the H200 that trainer
ran at 0.69x the FSDP actor, whose transformers experts already use ``grouped_mm``
(issue #35).

:class:`GroupedExperts` is ``SequentialMLP`` with another forward: the same submodules,
parameters, names and shapes (``local_experts.{e}.linear_fc1.weight`` ``[2I/etp, H]`` and
``linear_fc2.weight`` ``[H, I/etp]``), so checkpoints, the HF conversion, ``iter_hf_weights``,
megatron-core's DDP buffers and the distributed optimizer see nothing new. Its forward stacks
the local experts' weights and computes fc1, SwiGLU times the routing probability and fc2
over the tokens sorted by expert (megatron-core's dispatchers hand them sorted) as two
grouped GEMMs; the arithmetic per token is the same as ``MLP.forward``'s (the activation is
scaled by the float32 probability, then cast back).

The stacked weights are temporary: :class:`_GroupedLinear` saves the per-expert parameters
(no copy) for the backward and stacks them again there, so the activation memory of a layer
does not grow by a copy of all its experts (1.2 GB a layer for 30B-A3B in bf16). The
weight gradient is one grouped GEMM whose per-expert slices become each parameter's
gradient (megatron-core's DDP hooks add them into its float32 buffer as before).

Where the grouped kernel does not apply (no ``torch._grouped_mm``, a CUDA dtype other than
bf16, rows not 16-byte aligned, fp8, probabilities applied on the input, a clamped or offset
GLU, a single local expert) the forward is ``SequentialMLP``'s own.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import Tensor

logger = logging.getLogger(__name__)


def grouped_mm_available(x: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``x``'s device and dtype: bf16 on CUDA (sm80+
    from torch 2.9; Hopper before), any float dtype on the CPU (torch >= 2.9)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        major, minor = torch.cuda.get_device_capability(x.device)
        return x.dtype == torch.bfloat16 and (major, minor) >= (8, 0)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ W_e^T`` for per-expert weights ``W_e`` ``[out, in]``;
    ``offsets[e]`` is where expert ``e``'s rows end (int32, on ``x``'s device);
    ``empty`` lists the experts without a row (their weight gradient is set to zero here
    rather than trusted to a kernel's handling of a zero-length contraction)."""

    @staticmethod
    def forward(ctx, x: Tensor, offsets: Tensor, empty: list[int], *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        ctx.empty = empty
        stacked = torch.stack(weights)  # [E, out, in]; freed when this returns
        return torch._grouped_mm(x, stacked.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets)  # [S, in]
        grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)  # [E, out, in], ragged contraction
        if ctx.empty:
            grad_w[ctx.empty] = 0
        return grad_x, None, None, *grad_w.unbind(0)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` (same parameters and checkpoints) computed as two grouped GEMMs; see
    the module docstring. Selected by ``TransformerConfig.moe_grouped_gemm`` on the local
    (non-TE) spec (:func:`vlm_models.megatron.layers.layer_spec`)."""

    def _grouped_applies(self, x: Tensor) -> bool:
        cfg = self.config
        if (
            self.num_local_experts == 1
            or cfg.fp8
            or cfg.fp4
            or cfg.moe_apply_probs_on_input
            or not cfg.gated_linear_unit
            or cfg.add_bias_linear
            or cfg.use_te_activation_func
            or cfg.activation_func_clamp_value is not None
            or cfg.glu_linear_offset != 0.0
            or x.nelement() == 0
            or not grouped_mm_available(x)
            # traced, the op's shape function takes bf16 (or fp16) only, on every device
            or (torch.compiler.is_compiling() and x.dtype != torch.bfloat16)
        ):
            return False
        fc1 = self.local_experts[0].linear_fc1.weight
        # every operand's row stride (in and out features) must be a multiple of 16 bytes
        return all(n * x.element_size() % 16 == 0 for n in fc1.shape)

    def forward(
        self,
        permuted_local_hidden_states: Tensor,
        tokens_per_expert: Tensor,
        permuted_probs: Tensor,
    ):
        x = permuted_local_hidden_states
        if not self._grouped_applies(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        # megatron-core's all-to-all dispatcher hands the counts over on the host (it reads
        # them there anyway); the empty experts are known without a device read
        counts = tokens_per_expert.tolist()
        empty = [e for e, n in enumerate(counts) if n == 0]
        offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        offsets = offsets.to(x.device, non_blocking=True)
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        h = _GroupedLinear.apply(x, offsets, empty, *fc1)  # [S, 2I]
        gate, up = torch.chunk(h, 2, dim=-1)
        act = self.config.activation_func(gate) * up
        # as MLP.forward: the probability scales the activation (float32), then cast back
        act = (act * permuted_probs.unsqueeze(-1)).to(act.dtype)
        return _GroupedLinear.apply(act, offsets, empty, *fc2), None
