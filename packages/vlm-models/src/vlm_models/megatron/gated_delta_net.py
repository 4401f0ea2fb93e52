"""Qwen3.5's gated-delta-net layer on megatron-core's ``GatedDeltaNet``, with packed samples.

megatron-core 0.16.1's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net.py``) holds the
layer's parameters, tensor-parallel split and initialisation: ``in_proj`` (one column-parallel
projection, each rank's rows ``[q_r, k_r, v_r, z_r, beta_r, alpha_r]``), the depthwise
``conv1d`` (channels ``[q_r, k_r, v_r]``), ``A_log`` and ``dt_bias`` (per value head),
``out_norm`` and the row-parallel ``out_proj``. Its forward refuses packed sequences and its
constructor refuses to run without flash-linear-attention (``fla``), whose kernels only its
forward calls. :class:`PackedGatedDeltaNet` keeps all of that and gives the layer a forward
that takes packed THD rows, each sample's convolution window and recurrent state starting
from zero at its boundary, on one of two paths:

* ``fla`` (CUDA with ``fla-core`` installed): one ``chunk_gated_delta_rule`` call over the row
  with ``cu_seqlens`` (the kernel resets its state at each boundary) and q/k L2-normalised in
  the kernel; the convolution through ``causal_conv1d_fn(seq_idx=...)`` where that package is
  installed, else per sample in torch.
* ``torch`` (everywhere else, the CPU included): per sample, the convolution in torch and
  megatron-core's own torch reference of the delta rule (``torch_chunk_gated_delta_rule``,
  its deterministic-mode path), q/k L2-normalised in float32 as transformers does.

The arithmetic is transformers' ``Qwen3_5GatedDeltaNet``'s (the HF model is the reference):
``g = -exp(A_log) * softplus(alpha + dt_bias)``, ``beta = sigmoid(beta)``, the output
RMS-normalised per value head and gated by ``silu(z)``.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm import gated_delta_net as mcore_gdn
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

logger = logging.getLogger(__name__)

FLA_HINT = (
    "install flash-linear-attention's kernels: `uv sync --extra gpu` (or `pip install "
    "fla-core==0.6.0`; CUDA only)"
)


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention's delta-rule kernel, the one fla call this module makes,
    imports (fla-core 0.6.0 checked: its signature takes ``cu_seqlens``)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError as err:
        logger.warning("fla is installed but its gated delta rule does not import: %s", err)
        return False
    return True


@functools.cache
def fla_refusal(device: torch.device) -> str | None:
    """Why fla's kernels cannot train on ``device``, or None. fla-core 0.6.0 raises in the
    *backward* of ``chunk_gated_delta_rule`` on Hopper with Triton 3.4.0 up to 3.7.1 (wrong
    results, its issue #640) unless tilelang is installed: met on the H200 with torch 2.11's
    Triton, mid-step. Checked here so that ``auto`` picks the torch path before the step."""
    if device.type != "cuda" or not fla_available():
        return None if device.type == "cuda" else "fla runs on CUDA only"
    import triton

    major = torch.cuda.get_device_capability(device)[0]
    tilelang = importlib.util.find_spec("tilelang") is not None
    return fla_backward_refusal(major, triton.__version__, tilelang=tilelang)


def fla_backward_refusal(sm_major: int, triton_version: str, *, tilelang: bool) -> str | None:
    """fla-core 0.6.0's own rule (``fla/ops/common/chunk_o.py``) as a reason, or None."""
    from packaging.version import Version

    bad = Version("3.4.0") <= Version(triton_version) < Version("3.7.1")
    if sm_major == 9 and bad and not tilelang:
        return (
            f"fla's gated delta rule backward refuses Triton {triton_version} on Hopper "
            "(fla issue #640): upgrade Triton to 3.7.1 or later, or `pip install tilelang`"
        )
    return None


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("gated delta net: the torch path, since %s", reason)


def _fla_chunk_rule() -> Any:
    """fla's ``chunk_gated_delta_rule``, with a clear message where fla is missing."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise ImportError(f"the fla gated-delta-net path needs fla: {FLA_HINT}") from err
    return chunk_gated_delta_rule


def _causal_conv1d() -> Any | None:
    """The ``causal_conv1d`` package's varlen convolution (``seq_idx``), or None."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


@contextmanager
def _constructible_without_fla() -> Iterator[None]:
    """megatron-core 0.16.1 raises in ``GatedDeltaNet.__init__`` when fla is absent although
    only its forward (which this module replaces) uses fla; build it regardless."""
    saved = mcore_gdn.HAVE_FLA
    mcore_gdn.HAVE_FLA = True
    try:
        yield
    finally:
        mcore_gdn.HAVE_FLA = saved


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """q/k normalisation of transformers' Qwen3.5 (float32, ``x * rsqrt(sum(x^2) + eps)``)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class PackedGatedDeltaNet(GatedDeltaNet):
    """megatron-core's gated delta net whose forward takes packed THD samples (see module).

    ``path`` is ``"auto"`` (fla on CUDA where installed, else torch), ``"fla"`` or ``"torch"``.
    """

    packs_samples = True  # each sample of a packed row starts from a zero state

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        path: str = "auto",
        **kwargs: Any,
    ) -> None:
        if path not in ("auto", "fla", "torch"):
            raise ValueError(f"gated delta net path {path!r}: expected auto, fla or torch")
        if path == "fla" and not fla_available():
            raise ImportError(f"gated delta net path 'fla': {FLA_HINT}")
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        with _constructible_without_fla():
            super().__init__(
                config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs
            )
        self.path = path

    def kernel_path(self, device: torch.device) -> str:
        """``"fla"`` or ``"torch"``: what a forward on ``device`` runs."""
        if self.path == "auto":
            if device.type != "cuda" or not fla_available():
                return "torch"
            reason = fla_refusal(device)
            if reason is not None:
                _warn_once(reason)
            return "torch" if reason else "fla"
        if self.path == "fla" and (reason := fla_refusal(device)) is not None:
            raise RuntimeError(f"gated delta net path 'fla': {reason}")
        return self.path

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        *,
        packed_seq_params: PackedSeqParams | None = None,
        inference_context: Any = None,
        **_: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """``[s(/tp), b, h]`` -> (output ``[s(/tp), b, h]``, bias). Padded ``sbhd`` batches
        are right-padded (padding comes after a sample's tokens and never reaches them).

        Under context parallelism (``packed_seq_params.zigzag``) the layer all-gathers its
        projected inputs over CP, runs the recurrence on the whole padded row and keeps this
        rank's tokens: every CP rank holds the layer's full-row activations (the recurrence
        is sequential; passing the state between ranks would serialise them)."""
        if inference_context is not None:
            raise NotImplementedError("the gated delta net has no inference cache here")
        qkvzba, _ = self.in_proj(hidden_states)  # [S, b, d / tp] (gathered under SP)
        zigzag = getattr(packed_seq_params, "zigzag", None)
        if zigzag is not None:  # context parallel: the whole padded row on every CP rank
            qkvzba = zigzag.gather(qkvzba)
        qkvzba = qkvzba.transpose(0, 1)  # [b, S, d / tp]
        batch, seq_len, _ = qkvzba.shape
        tp = self.tp_size
        nv = self.num_value_heads // tp
        qkv, z, beta, alpha = torch.split(
            qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp, nv, nv], dim=-1
        )
        bounds = self._boundaries(packed_seq_params, batch, seq_len)
        path = self.kernel_path(qkvzba.device)
        qkv = self._conv(qkv.transpose(1, 2), bounds, packed_seq_params, path).transpose(1, 2)
        q, k, v = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], -1)
        q = q.reshape(batch, seq_len, -1, self.key_head_dim)
        k = k.reshape(batch, seq_len, -1, self.key_head_dim)
        v = v.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.num_value_heads != self.num_key_heads:
            ratio = self.num_value_heads // self.num_key_heads
            q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        beta = beta.sigmoid()
        if path == "fla":
            core = self._fla_rule(q, k, v, g, beta, packed_seq_params)
        else:
            core = self._torch_rule(q, k, v, g, beta, bounds)
        out = self._gated_norm(core, z.reshape(batch, seq_len, nv, self.value_head_dim))
        out = out.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()  # [S, b, v / tp]
        if zigzag is not None:
            out = zigzag.local_of_padded(out)  # this rank's tokens again
        return self.out_proj(out)

    @staticmethod
    def _boundaries(params: PackedSeqParams | None, batch: int, seq_len: int) -> list[int]:
        """Sample boundaries along the row (``[0, seq_len]`` when not packed)."""
        if params is None or params.qkv_format != "thd":
            return [0, seq_len]
        if batch != 1:
            raise ValueError(f"packed THD rows have batch 1, got {batch}")
        padded = params.cu_seqlens_q_padded
        cu = (padded if padded is not None else params.cu_seqlens_q).tolist()
        if cu[0] != 0 or cu[-1] != seq_len:
            raise ValueError(f"cu_seqlens {cu} do not cover the {seq_len} packed tokens")
        return cu

    def _conv(
        self, x: Tensor, bounds: list[int], params: PackedSeqParams | None, path: str
    ) -> Tensor:
        """Causal depthwise convolution + activation of ``x [b, d, S]``, per sample."""
        conv = _causal_conv1d() if path == "fla" else None
        if conv is not None:
            seq_idx = None
            if len(bounds) > 2:
                counts = torch.tensor(bounds, device=x.device).diff()
                ids = torch.arange(len(counts), device=x.device, dtype=torch.int32)
                seq_idx = ids.repeat_interleave(counts)[None]
            weight = self.conv1d.weight.squeeze(1)
            return conv(
                x.contiguous(),
                weight,
                self.conv1d.bias,
                activation=self.activation,
                seq_idx=seq_idx,
            )
        parts = [
            self.conv1d(x[..., start:end])[..., : end - start]
            for start, end in itertools.pairwise(bounds)
        ]
        return self.act_fn(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])

    def _fla_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, params: Any
    ) -> Tensor:
        cu = None
        if params is not None and params.qkv_format == "thd":
            padded = params.cu_seqlens_q_padded
            cu = (padded if padded is not None else params.cu_seqlens_q).long()
        # float32 inputs: fla keeps its chunk states and dots in the inputs' dtype, and the
        # engine's decode carries a float32 state (vlm_models.linear_attention's
        # use_float32_delta_rule does the same for the transformers model)
        core, _ = _fla_chunk_rule()(
            q.float().contiguous(),
            k.float().contiguous(),
            v.float().contiguous(),
            g=g,
            beta=beta.float(),
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )
        return core.to(v.dtype)

    @staticmethod
    def _torch_rule(
        q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, bounds: list[int]
    ) -> Tensor:
        """megatron-core's torch reference of the delta rule, each sample from a zero state."""
        dtype = v.dtype
        q, k = l2norm(q), l2norm(k)
        parts = []
        for start, end in itertools.pairwise(bounds):
            out, _ = mcore_gdn.torch_chunk_gated_delta_rule(
                q[:, start:end],
                k[:, start:end],
                v[:, start:end],
                g=g[:, start:end],
                beta=beta[:, start:end],
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=False,
            )
            parts.append(out)
        return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).to(dtype)

    def _gated_norm(self, x: Tensor, gate: Tensor) -> Tensor:
        """RMSNorm per value head, then ``* silu(gate)`` in float32 (``Qwen3_5RMSNormGated``)."""
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
        return y.to(x.dtype)


def gated_delta_net_spec(norm: type[nn.Module], *, path: str = "auto") -> ModuleSpec:
    """The token mixer of a Qwen3.5 linear-attention layer: megatron-core's column- and
    row-parallel linears around :class:`PackedGatedDeltaNet`, ``norm`` (not zero-centred: the
    gated norm's weight is stored as is) on each value head."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ModuleSpec(
        module=PackedGatedDeltaNet,
        params={"path": path},
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=ModuleSpec(module=norm, params={"zero_centered": False}),
            out_proj=RowParallelLinear,
        ),
    )


def packs_samples(model: nn.Module) -> bool:
    """Whether every gated-delta-net layer of ``model`` resets its state at sample boundaries
    (True for a model without such layers); a model where this is False must run one sample
    per packed row."""
    return all(
        getattr(m, "packs_samples", False) for m in model.modules() if isinstance(m, GatedDeltaNet)
    )
