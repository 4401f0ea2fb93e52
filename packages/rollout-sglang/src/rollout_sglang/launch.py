"""What a launcher needs from a `RolloutConfig`: a picklable factory that builds the engine
inside its Ray actor, and the weight transport for the layout. A setting that cannot work on
this machine or layout raises `ValueError` naming the flag, before anything starts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from rollout_sglang.config import RolloutConfig, build_engine
from rollout_sglang.sglang_engine import sglang_available
from rollout_sglang.weight_sync import choose_weight_transport


def uses_sglang(cfg: RolloutConfig, use_gpu: bool) -> bool:
    """Whether the engines are SGLang's (auto: on GPUs, where it is installed)."""
    return cfg.backend == "sglang" or (cfg.backend == "auto" and use_gpu and sglang_available())


def check_engines(cfg: RolloutConfig, *, use_gpu: bool) -> None:
    """Refuse (ValueError naming the flag) an engine this machine cannot run: SGLang where it
    is not installed, or where the run has no GPU. A launcher calls it before any work."""
    if cfg.backend != "sglang":
        return
    if not sglang_available():
        raise ValueError(
            "--rollout-engine sglang: SGLang is not installed (uv sync --extra gpu); "
            "--rollout-engine hf serves with transformers"
        )
    if not use_gpu:
        raise ValueError(
            "--rollout-engine sglang serves on GPUs and this run has none (--num-gpus 0); "
            "use --rollout-engine hf"
        )


def engine_factory(
    cfg: RolloutConfig,
    *,
    source: Any,
    use_gpu: bool,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Callable[[], Any]:
    """`factory()` builds one engine of `source` (a folder, hub id, preset or config) in its
    actor: SGLang on the actor's GPU(s), else the transformers engine. SGLang gets the prompt
    processor's pixel bounds, so that it expands each image to the trainer's token count."""
    if not uses_sglang(cfg, use_gpu):
        return functools.partial(
            build_hf_engine,
            source,
            list(eos_token_ids),
            pad_token_id,
            cfg.max_batch_size,
            dtype=cfg.dtype,
        )
    check_engines(cfg, use_gpu=use_gpu)
    if not isinstance(source, str):
        raise ValueError("the SGLang engine needs a model folder or hub id (use --load or a name)")
    # the whole rollout configuration (EP, speculative decoding, deterministic inference,
    # server arguments, dtype), with what only the launcher knows
    engine = dataclasses.replace(
        cfg,
        model_path=source,
        backend="sglang",
        base_gpu_id=0,  # an engine sees only its own GPU(s): Ray or its worker set them
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    return functools.partial(build_engine, engine)


def build_hf_engine(
    source: Any, eos_ids: list[int], pad_id: int, max_batch_size: int, dtype: str = "bfloat16"
) -> Any:
    """Runs inside a rollout Ray actor: the transformers engine (CPU, or a GPU without SGLang).

    On a GPU the model is built in ``dtype`` (the rollout's, bfloat16 by default, as SGLang
    serves): in float32 the decode step is compute-bound on float32 matmuls and its KV cache
    twice the size (3.6x slower a step on the H200, 2026-12-02). On the CPU it stays float32,
    which CPU kernels handle best and the CPU tests compare exactly."""
    import torch

    from rollout_sglang.hf_engine import HFEngine
    from vlm_models import build_model

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model = build_model(
        source,
        dtype=getattr(torch, dtype) if gpu else torch.float32,
        attn_implementation="sdpa",
        device=device,
    )
    return HFEngine(
        model,
        device=device,
        eos_token_ids=eos_ids,
        max_batch_size=max_batch_size,
        pad_token_id=pad_id,
    )


def weight_transport(
    cfg: RolloutConfig, *, colocate: bool, use_gpu: bool, num_trainers: int
) -> Any | None:
    """The transport factory for this layout (None: rl-runtime's object store): CUDA IPC
    colocated on one trainer GPU, NCCL to SGLang on GPUs of its own, unless `weight_transport`
    forces one."""
    try:
        return choose_weight_transport(
            colocate=colocate,
            use_gpu=use_gpu,
            sglang=uses_sglang(cfg, use_gpu),
            num_trainers=num_trainers,
            ranks_per_engine=cfg.tp_size,
            kind=cfg.weight_transport,
        )
    except ValueError as err:
        raise ValueError(f"--weight-transport {cfg.weight_transport}: {err}") from None
