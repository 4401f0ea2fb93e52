"""CPU-only shims (tests, debugging) that let Megatron-Core 0.16.1 run without CUDA.

Megatron-Core assumes a GPU in a few places that the local (non-TE) path otherwise runs fine
without:

* its model-parallel RNG tracker reads and writes CUDA RNG states (``fork()`` is entered by the
  decoder under sequence parallelism and by the embedding dropout);
* sequence-parallel gathers/scatters (``tensor_parallel.mappings``) and a few other helpers
  allocate buffers on ``torch.cuda.current_device()``;
* activation recomputation (``tensor_parallel.checkpoint``) saves and restores CUDA RNG states;
* with tied embeddings and pipeline parallelism, ``LanguageModule`` moves the last stage's
  copy of the embedding with ``weight.data.cuda()`` before the first/last-stage all-reduce.

:func:`apply` swaps in Megatron's own no-op inference RNG tracker, makes its CUDA RNG state
get/set helpers no-ops (there is no CUDA RNG; the CPU RNG state is still saved and restored), makes
``torch.cuda.current_device()`` answer ``"cpu"`` and ``Tensor.cuda()`` return the tensor
unchanged (without CUDA both would otherwise raise). It refuses to run where CUDA is available, so
none of it can reach a GPU run. Tests, the CPU mode of the benchmark and
``trainers_megatron.MegatronActor`` on a machine without CUDA call it (as
``vlm_models.megatron.apply_cpu_compat``); the model code itself never does.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_applied = False


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
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    _applied = True
    logger.info("Megatron CPU compatibility layer applied (tests only)")
