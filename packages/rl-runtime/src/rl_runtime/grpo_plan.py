"""What a GRPO run settles from its config before Ray, beside the layout (`rl_runtime.parallel`):
where the trainer's state sits while the engines generate (`colocation_plan`), the engines'
KV cache (`rollout_config`), the dtype the engine/trainer log-prob gap is judged in
(`compute_dtype`), and `--print-config`'s layout (`print_layout`). `cfg` is a
`rl_runtime.grpo_app.GrpoConfig`; `engines` the recipe's `EngineLauncher`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rl_runtime.cluster_config import layout
from rl_runtime.colocation import ColocationPlan, engine_cache, plan_colocation
from rl_runtime.logprob_guard import coarsest_dtype
from rl_runtime.memory import MemoryEstimate, ModelShape
from rl_runtime.parallel import (
    gpu_memory_bytes,
    host_budget,
    layout_report,
    plan_layout,
    state_estimate,
)
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import EngineLauncher, TrainerConfig

#: Prompt tokens assumed per sequence when ``--max-prompt-length`` is unset (Geometry3K's
#: prompts with their image: 109-436 tokens in the validation split).
ASSUMED_PROMPT_TOKENS = 1024


def longest_sample(cfg: Any) -> int:
    """Tokens of the longest sequence a step trains on (prompt and response), which one
    micro-batch holds whole: what the layout's memory estimate sizes context parallelism by."""
    return (cfg.data.max_prompt_length or ASSUMED_PROMPT_TOKENS) + cfg.loop.rollout_max_response_len


def compute_dtype(cfg: Any, use_gpu: bool) -> str:
    """The coarsest of the engine's and the trainer's compute dtypes and the dtype the weights
    are pushed in, whose band the log-prob gap between engine and trainer is judged by
    (``rl_runtime.logprob_guard``). On the CPU the transformers engine computes in float32,
    and the trainer by default, but the engine holds the weights as pushed (bfloat16 unless
    the trainer's ``export_dtype`` says otherwise)."""
    engine = cfg.rollout.dtype if use_gpu else "float32"
    trainer = cfg.trainer.param_dtype or ("bfloat16" if use_gpu else "float32")
    return coarsest_dtype(engine, trainer, cfg.trainer.export_dtype)


def colocation_plan(
    cfg: Any, fractions: Sequence[float] = (), *, engines: EngineLauncher
) -> ColocationPlan:
    """Where the trainer's state sits while the engine generates, for the settled layout in
    ``cfg.parallel``: ``--offload-train`` as set; unset, colocated on GPUs with the
    transformers engine, as ``rl_runtime.plan_colocation`` finds (on the GPU where the engine's
    KV cache holds a rollout beside it, else offloaded where the host holds it, else on the GPU
    with more of the optimizer on the host, one of ``fractions``: those the user left free).
    SGLang sizes its pool once at start, so it keeps the recipes' offload. Colocated on GPUs
    with the transformers engine and a known shape, the plan also sizes the engine's KV cache
    in tokens beside what the trainer keeps, the sequences' recurrent states (Qwen3.5's
    ``ModelShape.state_bytes_per_sequence``) counted, ``--offload-train`` set or not
    (``kv_cache_tokens``, the engine's ``cache_tokens`` unless set: :func:`rollout_config`)."""
    from vlm_models.sources import shape_of  # transformers: only when asked

    current, chosen = cfg.parallel.offload_fraction, cfg.loop.offload_train

    def unplanned(why: str) -> ColocationPlan:
        if chosen is not None:
            return ColocationPlan(current, chosen, "set")
        return ColocationPlan(current, True, why)

    lay = layout(cfg.cluster, gpus_per_engine=cfg.rollout.tp_size)
    if not (lay.colocate and lay.use_gpu):
        return unplanned("not colocated on GPUs")
    if engines.uses_sglang(cfg.rollout, lay.use_gpu):
        return unplanned("SGLang engine")
    shape = shape_of(cfg.model, load=cfg.run.load)
    gpu = gpu_memory_bytes(cfg.parallel)
    if shape is None or gpu is None:
        return unplanned("no memory estimate")
    model = ModelShape(**shape)

    def estimate_at(fraction: float) -> MemoryEstimate:
        parallel = cfg.parallel.with_optimizer_offload(fraction)
        out = state_estimate(parallel, cfg.cluster, trainer=cfg.trainer, shape=shape)
        assert out is not None  # GPUs and a known shape
        return out

    samples = cfg.loop.rollout_batch_size * cfg.loop.n_samples_per_prompt
    engine = dict(
        gpu_bytes=gpu,
        engine_sequences=min(cfg.rollout.max_batch_size, -(-samples // lay.num_engines)),
        engine_share=cfg.rollout.kv_cache_fraction,
        state_bytes_per_sequence=model.state_bytes_per_sequence,
    )
    slots = cfg.rollout.max_batch_size  # the cache holds at most what they fill at once
    if chosen is not None:  # the cache beside what the trainer keeps: nothing when offloaded
        estimate = estimate_at(current)
        if chosen:
            estimate = dataclasses.replace(estimate, kept=0.0)
        cap = slots * longest_sample(cfg)
        _, tokens = engine_cache(model, estimate, **engine, cap_tokens=cap)
        return ColocationPlan(current, chosen, "set", tokens or None)
    return plan_colocation(
        model,
        estimate_at,
        current=current,
        fractions=fractions,
        host_bytes=host_budget(
            cfg.parallel,
            cfg.cluster,
            model,
            with_engines=True,
            engines_park_weights=cfg.rollout.weights_cpu_backup,
        ),
        tokens_per_sequence=longest_sample(cfg),
        engine_slots=slots,
        **engine,
    )


def rollout_config(cfg: Any, plan: ColocationPlan) -> Any:
    """The engines' settings for the run: the colocation plan's KV-cache tokens as the
    transformers engine's ``cache_tokens``, unless ``--rollout-cache-tokens`` sets them (a
    user's value wins) or the plan has none (the engine then takes ``--kv-cache-fraction`` of
    the memory free)."""
    if cfg.rollout.cache_tokens is not None or plan.kv_cache_tokens is None:
        return cfg.rollout
    return dataclasses.replace(cfg.rollout, cache_tokens=plan.kv_cache_tokens)


def print_layout(
    cfg: Any, *, engines: EngineLauncher, others: Sequence[TrainerConfig] = ()
) -> dict[str, Any]:
    """`--print-config`'s training layout and its memory estimate (``others``: the backends
    not picked, for a refusal's suggestions)."""
    from vlm_models.sources import shape_of  # transformers: only when asked

    shape = shape_of(cfg.model, load=cfg.run.load) if cfg.cluster.use_gpu else None
    common = dict(
        trainer=cfg.trainer,
        shape=shape,
        others=others,
        model_name=cfg.model.model_name,
        longest_sample=longest_sample(cfg),
        engines_park_weights=cfg.rollout.weights_cpu_backup,
    )
    try:  # the offload decision of the layout the run would settle on (its optimizer offload)
        settled, _ = plan_layout(cfg.parallel, cfg.cluster, **common)
    except PreflightError:
        settled = cfg.parallel
    fractions = cfg.parallel.offload_options
    plan = colocation_plan(dataclasses.replace(cfg, parallel=settled), fractions, engines=engines)
    colocation: dict[str, Any] = {"on": plan.offload_train, "why": plan.why}
    if plan.kv_cache_tokens is not None or cfg.rollout.cache_tokens is not None:
        # the transformers engine's KV cache: the plan's tokens unless --rollout-cache-tokens
        colocation["kv_cache_tokens"] = plan.kv_cache_tokens
        colocation["cache_tokens"] = rollout_config(cfg, plan).cache_tokens
    raised = plan.optimizer_offload != settled.offload_fraction  # to give the cache room
    # the layout as the run will hold it: with a raised fraction, that fraction's estimate
    shown = settled.with_optimizer_offload(plan.optimizer_offload) if raised else cfg.parallel
    report = layout_report(shown, cfg.cluster, backend=cfg.run.backend, **common)
    if raised:
        colocation["optimizer_offload_fraction"] = plan.optimizer_offload
        report["optimizer_cpu_offload"] = (
            f"chosen: {settled.offload_fraction:.0%} of it on the host for the layout, raised to "
            f"{plan.optimizer_offload:.0%} colocated (offload_train says why)"
        )
    out = {"layout": report, "offload_train": colocation}
    if cfg.cluster.ray_to_join is None:  # where each actor goes: only on a cluster
        return out
    from rl_runtime.cluster import placement_preview  # Ray

    lay = layout(cfg.cluster, gpus_per_engine=cfg.rollout.tp_size)
    return out | {"placement": placement_preview(cfg.cluster, lay)}
