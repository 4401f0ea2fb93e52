"""What a launcher needs from a `RolloutConfig`: a picklable factory that builds the engine
inside its Ray actor, and the weight transport for the layout. A setting that cannot work on
this machine or layout raises `ValueError` naming the flag, before anything starts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, get_args

from rollout_sglang.build import build_engine
from rollout_sglang.config import RolloutConfig, TransportKind
from rollout_sglang.sglang_client.common import sglang_available
from weight_sync.weight_names import WeightNameCheck


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
        # the whole rollout configuration too (decode attention, KV-cache share, graphs...)
        return functools.partial(build_hf_engine, cfg, source, list(eos_token_ids), pad_token_id)
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


def build_hf_engine(cfg: RolloutConfig, source: Any, eos_ids: list[int], pad_id: int) -> Any:
    """Runs inside a rollout Ray actor: the transformers engine (CPU, or a GPU without SGLang).

    On a GPU the model is built in ``cfg.dtype`` (bfloat16 by default, as SGLang
    serves): in float32 the decode step is compute-bound on float32 matmuls and its KV cache
    twice the size (3.6x slower a step on the H200, 2026-12-02). On the CPU it stays float32,
    which CPU kernels handle best and the CPU tests compare exactly."""
    import torch

    from rollout_sglang.hf.engine import ENGINE_MODEL_OPTIONS, HFEngine
    from vlm_models.build import build_model

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model = build_model(
        source,
        dtype=getattr(torch, cfg.dtype) if gpu else torch.float32,
        attn_implementation=cfg.attn_implementation,
        device=device,
        **ENGINE_MODEL_OPTIONS,
    )
    return HFEngine(
        model,
        device=device,
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        **cfg.hf_engine_options(),
    )


def weight_transport(
    cfg: RolloutConfig,
    *,
    colocate: bool,
    use_gpu: bool,
    num_trainers: int,
    disk_folder: str | None = None,
) -> Any | None:
    """The transport factory for this layout (None: rl-runtime's object store): CUDA IPC
    colocated on one trainer GPU, NCCL to SGLang on GPUs of its own, unless `weight_transport`
    forces one. `disk_folder`: where the disk transport writes (a run-dir subfolder; None: a
    temporary folder)."""
    try:
        return choose_weight_transport(
            colocate=colocate,
            use_gpu=use_gpu,
            sglang=uses_sglang(cfg, use_gpu),
            num_trainers=num_trainers,
            ranks_per_engine=cfg.tp_size,
            kind=cfg.weight_transport,
            disk_folder=disk_folder,
        )
    except ValueError as err:
        raise ValueError(f"--weight-transport {cfg.weight_transport}: {err}") from None


#: What ``choose_weight_transport(kind=...)`` (and the launchers' ``--weight-transport``) take.
TRANSPORT_KINDS: tuple[str, ...] = get_args(TransportKind)


def choose_weight_transport(
    *,
    colocate: bool,
    use_gpu: bool,
    sglang: bool,
    num_trainers: int = 1,
    ranks_per_engine: int = 1,
    weight_names: WeightNameCheck | None = None,
    kind: str = "auto",
    disk_folder: str | None = None,
) -> Any | None:
    """The transport factory (``weight_sync``) for a layout, or None for the caller's default
    (rl-runtime: Ray's object store).

    ``kind="auto"`` picks by the layout:

    - colocated on GPUs with one trainer rank: CUDA IPC (rank 0 shares its GPU with every
      engine); with several ranks, engines sit on other ranks' GPUs, which rank 0's handles do
      not reach: the object store (a per-rank IPC is not built yet);
    - separate placement on GPUs, SGLang engines: NCCL broadcast (the transformers engine has
      no receiving side for it: the object store);
    - CPU: the object store.

    Another kind forces that transport, and a layout it cannot serve raises ``ValueError``
    saying why (``object-store`` serves every layout: the fallback when a faster one fails;
    ``disk`` serves every layout whose engines see ``disk_folder``, never picked by auto).
    """
    from weight_sync.cuda_ipc import CudaIpc
    from weight_sync.disk import Disk
    from weight_sync.nccl import Nccl

    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"weight transport {kind!r}: expected one of {', '.join(TRANSPORT_KINDS)}")
    ipc = CudaIpc(sglang=sglang, tp_size=ranks_per_engine, weight_names=weight_names)
    nccl = Nccl(ranks_per_engine=ranks_per_engine, weight_names=weight_names)
    if kind == "object-store":
        return None
    if kind == "disk":
        return Disk(disk_folder)
    if kind == "cuda-ipc":
        if not (use_gpu and colocate and num_trainers == 1):
            raise ValueError(
                "weight transport cuda-ipc needs the engines colocated with one trainer rank on "
                "its GPU (several ranks, CPU runs and separate rollout GPUs use another)"
            )
        return ipc
    if kind == "nccl":
        if not (use_gpu and not colocate and sglang):
            raise ValueError(
                "weight transport nccl needs SGLang engines on GPUs of their own "
                "(--no-colocate; the transformers engine has no receiving side)"
            )
        return nccl
    if not use_gpu:
        return None
    if colocate:
        return ipc if num_trainers == 1 else None
    return nccl if sglang else None
