"""CPU-only shims (tests, debugging) that let Megatron-Core 0.16.1 run without CUDA.

Megatron-Core assumes a GPU in a few places that the local (non-TE) path otherwise runs fine
without:

* its model-parallel RNG tracker reads and writes CUDA RNG states (``fork()`` is entered by the
  decoder under sequence parallelism and by the embedding dropout);
* sequence-parallel gathers/scatters (``tensor_parallel.mappings``), the DDP gradient buffers
  and a few other helpers allocate on ``torch.cuda.current_device()``;
* activation recomputation (``tensor_parallel.checkpoint``) saves and restores CUDA RNG states;
* with tied embeddings and pipeline parallelism, ``LanguageModule`` moves the last stage's
  copy of the embedding with ``weight.data.cuda()`` before the first/last-stage all-reduce;
* the pipeline schedules (``pipeline_parallel/schedules.py``: ``total_num_tokens``) and the
  mixed-precision / distributed optimizers (``optimizer/optimizer.py``: ``_scale_one``,
  ``_dummy_overflow_buf``, ``found_inf``) allocate with a literal ``device="cuda"``;
* the pipeline's shape exchange (``p2p_communication._communicate_shapes``, taken with
  ``variable_seq_lengths``) calls ``torch.cuda.synchronize()``;
* the optimizers sort parameters by ``param.type()`` and accept only the
  ``torch.cuda.{Float,Half,BFloat16}Tensor`` names (``optimizer.py``,
  ``distrib_optimizer.py``);
* the MoE all-to-all token dispatcher (``transformer/moe/token_dispatcher.py``) creates a CUDA
  stream at construction and moves its split sizes to the host on it
  (``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which leaves a CPU tensor a tensor: the
  all-to-all then refuses it as a list of sizes);
* the optimizer CPU offload (``optimizer/cpu_offloading/hybrid_optimizer.py``,
  ``HybridDeviceOptimizer``) copies on CUDA streams, offloads only CUDA parameters (its host
  half looks every stepped tensor up as the host copy of one) and moves the device half's
  loaded state with ``.to("cuda")``.

:func:`apply` swaps in Megatron's own no-op inference RNG tracker, makes its CUDA RNG state
get/set helpers no-ops (there is no CUDA RNG; the CPU RNG state is still saved and restored),
makes ``torch.cuda.current_device()`` answer ``"cpu"``, ``Tensor.cuda()`` return the tensor
unchanged and ``torch.cuda.synchronize()`` do nothing (without CUDA all three would raise),
gives the two modules with ``device="cuda"`` literals a view of ``torch`` whose tensor
factories put such tensors on the CPU, gives the token dispatcher a view whose CUDA streams
are one stand-in that does nothing (CPU work runs in order) and a host copy that turns CPU
split sizes into the numpy arrays it gets from a GPU, gives the hybrid optimizer the same streams
and, in place of its class, :class:`HostAsDeviceOptimizer` (the CPU plays the device: the first
``offload_fraction`` of the elements get a host copy each, stepped by the host optimizer and
copied back, as CUDA parameters would), and makes ``Tensor.type()`` (no argument) name a CPU
tensor as its CUDA counterpart (only megatron-core compares these names; torch uses them as
dictionary keys). It refuses to run where CUDA is available, so none of it can reach a GPU run.
Tests, the CPU mode of the benchmark and ``trainers_megatron.MegatronActor`` on a machine
without CUDA call it (as ``vlm_models.megatron.apply_cpu_compat``); the model code itself
never does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_applied = False

#: megatron-core modules that allocate with a literal ``device="cuda"`` on paths we take.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
)
#: ... and that use CUDA streams.
_CUDA_STREAM_MODULES = (
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
)
_FACTORIES = ("empty", "full", "ones", "tensor", "zeros")


def _on_cpu(factory: Any) -> Any:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _NoStream:
    """A CUDA stream (and its events) on the CPU, where work already runs in order."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` for one module: every stream is the one :class:`_NoStream`."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        stream = _NoStream()
        self.Stream = lambda *args, **kwargs: stream
        self.current_stream = lambda *args, **kwargs: stream
        self.default_stream = lambda *args, **kwargs: stream
        self.stream = lambda *args, **kwargs: contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` for one module, whose tensor factories read ``device="cuda"`` as the CPU
    (and, with ``streams``, whose CUDA streams do nothing)."""

    def __init__(self, *, streams: bool = False) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))
        if streams:
            self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _host_copy(original: Any) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` that also gives a CPU tensor as numpy when asked."""

    @functools.wraps(original)
    def copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return copy


def _host_as_device_class() -> type:
    """``HybridDeviceOptimizer`` for a machine without CUDA (see :func:`apply`)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    class HostAsDeviceOptimizer(HybridDeviceOptimizer):
        """megatron-core's hybrid optimizer with the CPU as the device: the first
        ``offload_fraction`` of the elements are offloaded (a separate host copy each, float32
        with ``param_update_in_fp32``), the rest stay with the "device" optimizer, float32
        copies for low-precision parameters. The maps are the ones megatron-core builds for CUDA
        parameters, so its step, hooks and state dicts run unchanged."""

        def _get_sub_optimizer_param_groups(self, offload_fraction: float):
            params = [p for group in self.param_groups for p in group["params"]]
            threshold = offload_fraction * sum(p.numel() for p in params)
            moved = 0
            host_groups, device_groups = [], []
            to_copy, from_copy, fp32 = {}, {}, {}
            for group in self.param_groups:
                host, device = {**group, "params": []}, {**group, "params": []}
                for p in group["params"]:
                    offload = moved < threshold
                    inner = p.detach().clone() if offload else p
                    if self.param_update_in_fp32 and inner.dtype != torch.float32:
                        inner = inner.detach().clone().float()
                        fp32[p] = inner
                    if offload:
                        moved += p.numel()
                        to_copy[p], from_copy[inner] = inner, p
                        host["params"].append(inner)
                    else:
                        device["params"].append(inner)
                host_groups += [host] if host["params"] else []
                device_groups += [device] if device["params"] else []
            return host_groups, device_groups, to_copy, from_copy, fp32

        def _move_new_state_to_right_device(self) -> None:
            """One device: loaded state is where it belongs."""

    return HostAsDeviceOptimizer


_tensor_type = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = _tensor_type(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or self.device.type != "cpu":
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def apply() -> None:
    """Make Megatron-Core usable on CPU for this process (idempotent; refuses on CUDA)."""
    global _applied
    if torch.cuda.is_available():
        raise RuntimeError("the Megatron CPU compatibility layer must not be used with CUDA")
    if _applied:
        return
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.Tensor.type = _cuda_type_name  # type: ignore[method-assign]
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = _TorchOnCpu()
    for name in _CUDA_STREAM_MODULES:
        importlib.import_module(name).torch = _TorchOnCpu(streams=True)
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy(
        token_dispatcher.maybe_move_tensor_to_cpu
    )
    import megatron.core.optimizer as optimizer_module
    from megatron.core.optimizer import distrib_optimizer

    host_as_device = _host_as_device_class()
    optimizer_module.HybridDeviceOptimizer = host_as_device
    distrib_optimizer.HybridDeviceOptimizer = host_as_device
    _applied = True
    logger.info("Megatron CPU compatibility layer applied (tests only)")
