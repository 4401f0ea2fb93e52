"""Start torch.distributed and Megatron's model-parallel groups for this package's models."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from vlm_models.megatron.config import Parallelism

logger = logging.getLogger(__name__)


def initialize_model_parallel(parallel: Parallelism | None = None, *, seed: int = 0) -> None:
    """Initialise the process group (if needed) and Megatron's TP/CP/PP/EP groups.

    The process group comes from the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT`` variables (NCCL with CUDA, gloo without); without ``RANK``/``WORLD_SIZE``
    it is a world of one and needs none.
    On CUDA the model-parallel RNG tracker is seeded as Megatron expects. Without CUDA this
    does not patch anything: tests apply :mod:`vlm_models.megatron._cpu_compat` themselves.
    """
    parallel = parallel or Parallelism()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            # A world of one on an in-memory store: no port to collide on, and nothing is
            # written to os.environ (a MASTER_PORT left there reaches every Ray worker started
            # later from this process, and they all bind it).
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        context_parallel_size=parallel.cp,
    )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    logger.info(
        "model parallel ready: world %d, tp %d, cp %d, pp %d, ep %d",
        dist.get_world_size(),
        parallel.tp,
        parallel.cp,
        parallel.pp,
        parallel.ep,
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and the process group (tests, tools)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
