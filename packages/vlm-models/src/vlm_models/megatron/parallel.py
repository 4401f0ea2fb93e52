"""Start torch.distributed and Megatron's model-parallel groups for this package's models."""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from vlm_models.megatron.config import Parallelism

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def initialize_model_parallel(parallel: Parallelism | None = None, *, seed: int = 0) -> None:
    """Initialise the process group (if needed) and Megatron's TP/PP/EP groups.

    The process group comes from the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT`` variables (NCCL with CUDA, gloo without); a single process needs none.
    On CUDA the model-parallel RNG tracker is seeded as Megatron expects. Without CUDA this
    does not patch anything: tests apply :mod:`vlm_models.megatron._cpu_compat` themselves.
    """
    parallel = parallel or Parallelism()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if int(os.environ.get("WORLD_SIZE", 1)) == 1:
            # one process: any free port (a fixed one collided with another run's trainer)
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("MASTER_PORT", "29511")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            backend,
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    logger.info(
        "model parallel ready: world %d, tp %d, pp %d, ep %d",
        dist.get_world_size(),
        parallel.tp,
        parallel.pp,
        parallel.ep,
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and the process group (tests, tools)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
