"""What both launchers settle in the driver before Ray or any model starts: the model named
resolved to local files (hub ids downloaded once, here), and a training layout that fits the
GPUs by the memory estimate of `rl_runtime.memory` (chosen when left unset, refused when set
and too big). Neither touches GPU memory.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from geo3k_sft.common import (
    TINY_MODEL,
    ModelSection,
    RunSection,
    layout,
    recompute_mode,
    resolve_load,
)
from rl_runtime import (
    MemoryEstimate,
    ModelShape,
    PreflightError,
    TrainLayout,
    check_gpus,
    check_layout,
    choose_layout,
    estimate_memory,
)

GiB = 1 << 30

log = logging.getLogger(__name__)

HUB_NAMESPACE = "Qwen"  # a bare name such as Qwen3-VL-8B-Instruct is Qwen/Qwen3-VL-8B-Instruct
#: Hub names whose architecture a shape preset has: the layout is estimated before downloading.
SHAPE_OF_NAME = {
    "Qwen3-VL-2B-": "qwen3-vl-2b",
    "Qwen3-VL-4B-": "qwen3-vl-4b",
    "Qwen3-VL-8B-": "qwen3-vl-8b",
    "Qwen3-VL-30B-A3B-": "qwen3-vl-30b-a3b",
}


# ---------------------------------------------------------------------------------- loading


def resolve_model(model: ModelSection, run: RunSection) -> ModelSection:
    """``model`` with ``model_name`` (and a hub ``tokenizer``) turned into local folders, or
    a preset name; a name that cannot be resolved stops the run (exit status 2)."""
    from vlm_models import SHAPE_PRESETS, ModelSourceError, resolve_model_source

    name, tokenizer = model.model_name, model.tokenizer
    try:
        if run.load is None and name != TINY_MODEL:
            name = resolve_model_source(name, hub_namespace=HUB_NAMESPACE, require_weights=True)
    except ModelSourceError as err:
        raise PreflightError(f"--model-name: {err}") from None
    try:
        if tokenizer not in (None, "tiny"):
            tokenizer = resolve_model_source(tokenizer, hub_namespace=HUB_NAMESPACE)
    except ModelSourceError as err:
        raise PreflightError(f"--tokenizer: {err}") from None
    if run.load is None and name in SHAPE_PRESETS and tokenizer is None:
        raise PreflightError(
            f"--model-name {name} is a shape preset (random weights) and has no processor: "
            "name one with --tokenizer FOLDER (any Qwen3-VL model folder)"
        )
    return dataclasses.replace(model, model_name=name, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------- layout


def model_config(model: ModelSection, run: RunSection) -> Any | None:
    """The model's config where it is known without downloading weights, else None."""
    from transformers import AutoConfig

    from vlm_models import PRESETS, preset_config

    if run.load:
        return AutoConfig.from_pretrained(resolve_load(run.load))
    name = model.model_name
    if name in PRESETS:
        return preset_config(name)
    folder = Path(name).expanduser()
    for candidate in (folder / "hf", folder):
        if (candidate / "config.json").is_file():
            return AutoConfig.from_pretrained(candidate)
    base = name.rsplit("/", 1)[-1]
    shape = next((p for prefix, p in SHAPE_OF_NAME.items() if base.startswith(prefix)), None)
    return preset_config(shape) if shape else None


def model_shape(config: Any) -> ModelShape:
    """The numbers `rl_runtime.memory` needs, from an HF config (MoE: a token's experts)."""
    from vlm_models import parameter_counts

    tc = getattr(config, "text_config", config)
    inter, experts = tc.intermediate_size, 0
    if getattr(tc, "num_experts", 0):
        shared = getattr(tc, "shared_expert_intermediate_size", 0) or 0
        inter = tc.num_experts_per_tok * tc.moe_intermediate_size + shared
        # gate, up and down projections of every routed expert of every layer
        experts = tc.num_hidden_layers * tc.num_experts * 3 * tc.hidden_size
        experts *= tc.moe_intermediate_size
    vc = getattr(config, "vision_config", None)
    counts = parameter_counts(config)
    return ModelShape(
        language_params=counts["language"],
        vision_params=counts["vision"],
        hidden_size=tc.hidden_size,
        intermediate_size=inter,
        num_layers=tc.num_hidden_layers,
        vocab_size=tc.vocab_size,
        vision_hidden_size=vc.hidden_size if vc else 0,
        vision_intermediate_size=vc.intermediate_size if vc else 0,
        vision_depth=vc.depth if vc else 0,
        expert_params=experts,
    )


def gpu_memory_bytes(run: RunSection) -> float | None:
    """Memory of the smallest visible GPU: ``--gpu-memory-gib``, else its total memory from
    ``torch.cuda.get_device_properties``, which allocates nothing (``mem_get_info`` would need
    a CUDA context, hundreds of MiB, in the driver); None: no check."""
    if run.gpu_memory_gib is not None:
        return run.gpu_memory_gib * GiB if run.gpu_memory_gib > 0 else None
    import torch

    if not torch.cuda.is_available():
        return None
    return min(
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    )


def _requested(model: ModelSection, run: RunSection, world: int) -> TrainLayout:
    megatron = run.backend == "megatron"
    return TrainLayout(
        backend=run.backend,
        world_size=world,
        max_tokens_per_gpu=model.max_tokens_per_gpu,
        tp=(model.tensor_parallel or 1) if megatron else 1,
        sp=bool(model.sequence_parallel) and megatron,
        recompute=recompute_mode(model) == "full",  # selective: counted as none
        replicate=model.fsdp_replicate and run.backend == "fsdp",
        pp=model.pipeline_parallel if megatron else 1,
        ep=model.expert_parallel if megatron else 1,
        distributed_optimizer=model.distributed_optimizer,
    )


def plan_layout(
    model: ModelSection, run: RunSection, *, with_engines: bool = True
) -> tuple[ModelSection, MemoryEstimate | None]:
    """``model`` with the layout settled, and its memory estimate (None: a CPU run, or the
    model's config or the GPU's memory is not known). Unset layout flags get the first layout
    that fits; set ones are kept, and a layout that cannot fit stops the run with the numbers
    and a suggestion."""
    unset = model.tensor_parallel is None and model.sequence_parallel is None
    unset = unset and model.gradient_checkpointing is None and model.recompute == "auto"
    estimate = None
    if run.num_gpus > 0:
        config = model_config(model, run)
        gpu = gpu_memory_bytes(run)
        if config is not None and gpu is not None:
            shape = model_shape(config)
            requested = _requested(model, run, layout(run, with_engines=with_engines).num_trainers)
            if unset:
                requested, _ = choose_layout(shape, requested, gpu)
            estimate = check_layout(shape, requested, gpu, model=model.model_name)
            log.info(
                "layout: %s; about %.1f GiB per GPU of %.1f (%s)",
                requested.describe(),
                estimate.total / GiB,
                gpu / GiB,
                estimate.breakdown(),
            )
            if unset:
                model = dataclasses.replace(
                    model,
                    tensor_parallel=requested.tp,
                    sequence_parallel=requested.sp,
                    gradient_checkpointing=requested.recompute,
                )
    return dataclasses.replace(
        model,
        tensor_parallel=model.tensor_parallel or 1,
        sequence_parallel=bool(model.sequence_parallel),
        gradient_checkpointing=recompute_mode(model) == "full",
    ), estimate


def layout_report(model: ModelSection, run: RunSection, *, with_engines: bool = True) -> dict:
    """For ``--print-config``: the layout the run would use and its memory estimate, or why
    there is none; a layout that cannot fit is reported, not raised."""
    if run.num_gpus <= 0:
        return {"description": f"CPU run, {run.backend}, {run.cpu_trainers} trainer rank(s)"}
    config = model_config(model, run)
    gpu = gpu_memory_bytes(run)
    if config is None or gpu is None:
        missing = "the model's config" if config is None else "the GPU memory (--gpu-memory-gib)"
        return {"description": f"not estimated: {missing} is not known before the run"}
    try:
        _, estimate = plan_layout(model, run, with_engines=with_engines)
    except PreflightError as err:
        requested = _requested(model, run, layout(run, with_engines=with_engines).num_trainers)
        report = estimate_memory(model_shape(config), requested).to_dict(gpu)
        return {**report, "refused": err.message}
    assert estimate is not None
    return estimate.to_dict(gpu)


def prepare_model(
    model: ModelSection, run: RunSection, *, with_engines: bool = True
) -> ModelSection:
    """Everything about the model a launcher settles before Ray, in order: the layout where the
    config is known without a download (so a layout that cannot fit stops before it), the GPU
    count, the model's local files, then the layout of a model known only once downloaded."""
    planned, estimate = plan_layout(model, run, with_engines=with_engines)
    check_gpus(run.num_gpus, preset=run.preset)
    if estimate is not None:
        return resolve_model(planned, run)
    return plan_layout(resolve_model(model, run), run, with_engines=with_engines)[0]
