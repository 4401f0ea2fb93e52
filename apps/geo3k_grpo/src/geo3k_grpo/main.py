"""`uv run apps/geo3k_grpo`: GRPO on Geometry3K (the miles / slime geo3k VLM recipe).

`main` parses the configuration (`config.py`); `run` builds the parts from it, each with its
package's own function, and hands them to `rl_runtime.run_grpo`. `--preset tiny` runs the whole
thing on a CPU in minutes, after a short SFT warm-up (`rl_runtime.sft_warmup`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geo3k_grpo.config import ACTORS, ENV_ALIASES, PRESETS, Geo3kGrpoConfig, parse
from rl_runtime import (
    PreflightError,
    RunContext,
    as_config_error,
    check_gpus,
    check_output_dir,
    check_resume,
    setup_logging,
    to_json,
    user_errors,
)
from vlm_data.paths import DatasetLoadError, check_dataset
from vlm_models import ModelSourceError
from vlm_models.hub import check_model

__all__ = ["PRESETS", "Geo3kGrpoConfig", "check", "main", "parse", "run"]

log = logging.getLogger(__name__)

DATASET = f"--dataset / {ENV_ALIASES['dataset'][0]}"  # how a dataset error names the setting
OUTPUT_DIR = f"--output-dir / {ENV_ALIASES['output_dir'][0]}"


def check(cfg: Geo3kGrpoConfig) -> None:
    """What parsing cannot see, checked before anything is printed or written (and before
    torch loads): the run folder can be one (and a `--resume` of it would not replace
    metrics with no checkpoint to continue them), a local dataset is there with its training
    split's files, this machine has the GPUs, and the model (and --tokenizer, --load) exists:
    a local folder, or a hub id on the hub or in the cache (asked, not downloaded)."""
    check_output_dir(cfg.run.output_dir, OUTPUT_DIR)
    if cfg.run.resume:
        check_resume(cfg.run.output_dir)
    with as_config_error(DatasetLoadError, DATASET):
        check_dataset(cfg.data)
    check_gpus(cfg.cluster.num_gpus, preset=cfg.run.preset)
    check_model(cfg.model, load=cfg.run.load)


def warm_up(cfg: Geo3kGrpoConfig) -> Path:
    """A short SFT run, so that a random model learns the answer format; GRPO loads its folder."""
    import vlm_data.sources
    import vlm_data.tokens
    import vlm_models.sources
    from rl_runtime import sft_warmup, to_dict

    processor = vlm_data.sources.load_processor(
        vlm_models.sources.processor_source(cfg.model), cfg.data
    )
    w = cfg.warmup
    token_ids = vlm_data.tokens.model_token_ids(processor)
    vlm_models.sources.check_token_ids(cfg.model, token_ids)
    trainer = cfg.trainer.for_run(
        RunContext(
            model=vlm_models.sources.model_source(cfg.model, token_ids=token_ids),
            seed=cfg.run.seed,
            use_gpu=cfg.cluster.use_gpu,
            layout=cfg.parallel.trainer_layout(),
            total_steps=w.warmup_sft_steps,
            schedule=w.schedule(),
        )
    )

    def samples() -> Any:
        with as_config_error(DatasetLoadError, DATASET):
            return vlm_data.sources.sft_source(cfg.data, processor, seed=cfg.run.seed)

    return sft_warmup(
        w,
        run=cfg.run,
        cluster=cfg.cluster,
        trainer=trainer,
        actor_class=ACTORS[cfg.run.backend],
        samples=samples,
        tp_size=cfg.parallel.tp_cp_size,
        config=to_dict(cfg),
        on_export=processor.save_pretrained,
    )


def run(cfg: Geo3kGrpoConfig) -> list[dict[str, Any]]:
    """Settle the model and layout, build the data, trainer, engines and Ray, then train."""
    import rollout_sglang.launch  # torch, Ray, transformers: imported once the flags are checked
    import rollout_sglang.types
    import vlm_data.sources
    import vlm_data.tokens
    import vlm_models.sources
    from geo3k_grpo.config import (
        colocation_plan,
        compute_dtype,
        longest_sample,
        other_trainers,
        rollout_config,
    )
    from rl_runtime import (
        CheckpointManager,
        Cluster,
        GrpoParts,
        RunLogger,
        check_backend,
        layout,
        resume_step,
        run_grpo,
        settle,
        to_dict,
        write_config,
    )
    from rl_runtime.logprob_guard import LINEAR_ATTENTION
    from rl_runtime.loop_config import routing_replay_on

    actor_class = ACTORS[cfg.run.backend]
    check_backend(cfg.run.backend, cfg.trainer, actor_class, use_gpu=cfg.cluster.use_gpu)
    lay = layout(cfg.cluster, gpus_per_engine=cfg.rollout.tp_size)
    try:  # colocated on a GPU: CUDA IPC; SGLang on GPUs of its own: NCCL; else Ray's store
        rollout_sglang.launch.check_engines(cfg.rollout, use_gpu=lay.use_gpu)
        kw = {"colocate": lay.colocate, "use_gpu": lay.use_gpu, "num_trainers": lay.num_trainers}
        # --weight-transport disk writes the buckets where the run's files are, to inspect
        disk_folder = str((Path(cfg.run.output_dir) / "weight-sync").resolve())
        transport = rollout_sglang.launch.weight_transport(
            cfg.rollout, **kw, disk_folder=disk_folder
        )
    except ValueError as err:
        raise PreflightError(str(err)) from None
    load = cfg.run.load
    model, parallel = settle(
        cfg.model,
        cfg.parallel,
        cfg.cluster,
        cfg.run,
        trainer=cfg.trainer,
        others=other_trainers(cfg.run.backend),
        shape_of=vlm_models.sources.shape_of,
        resolve=vlm_models.sources.resolve_model,
        longest_sample=longest_sample(cfg),
        engines_park_weights=cfg.rollout.weights_cpu_backup,
    )
    free = cfg.parallel.offload_options  # optimizer fractions the user left to the launcher
    cfg = dataclasses.replace(cfg, model=model, parallel=parallel)
    # colocated: the trainer's state during rollout, which may put more of the optimizer on
    # the host (a host too small to take the state for each rollout)
    plan = colocation_plan(cfg, free)
    if plan.optimizer_offload != parallel.offload_fraction:  # said with the plan, below
        parallel = parallel.with_optimizer_offload(plan.optimizer_offload)
        cfg = dataclasses.replace(cfg, parallel=parallel)
    # the transformers engine's KV cache in tokens: the plan's, unless --rollout-cache-tokens
    cache_from = "planned" if cfg.rollout.cache_tokens is None else "--rollout-cache-tokens"
    # MoE: the trainer routes each token to the engine's experts (--routing-replay)
    shape = vlm_models.sources.shape_of(cfg.model, load=load) or {}
    moe = shape.get("expert_params", 0) > 0
    # Qwen3.5's gated delta net: the log-prob gap is judged in its family's band
    family = LINEAR_ATTENTION if shape.get("state_bytes_per_sequence", 0) > 0 else None
    replay = routing_replay_on(cfg.loop.routing_replay, moe)
    engine_cfg = dataclasses.replace(rollout_config(cfg, plan), return_routed_experts=replay)
    cfg = dataclasses.replace(cfg, rollout=engine_cfg)
    run_dir = Path(cfg.run.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.loop.keep_checkpoints)
    start_step = resume_step(checkpoints, run_dir) if cfg.run.resume else None
    write_config(cfg, run_dir)
    if load is None and cfg.warmup.warmup_sft_steps > 0:
        load = str(warm_up(cfg))
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, load=load))

    processor = vlm_data.sources.load_processor(
        vlm_models.sources.processor_source(cfg.model, load=load), cfg.data
    )
    d, seed = cfg.data, cfg.run.seed
    with as_config_error(DatasetLoadError, DATASET):
        train_prompts = vlm_data.sources.prompt_source(d, processor, d.train_split, seed=seed)
        eval_prompts = None
        if cfg.loop.eval_interval:
            eval_prompts = vlm_data.sources.prompt_source(
                d, processor, d.eval_split, eval_split=True, seed=seed
            )
    token_ids = vlm_data.tokens.model_token_ids(processor)
    vlm_models.sources.check_token_ids(cfg.model, token_ids, load=load)
    source = vlm_models.sources.model_source(cfg.model, load=load, token_ids=token_ids)
    trainer = cfg.trainer.for_run(
        RunContext(
            model=source,
            seed=seed,
            use_gpu=lay.use_gpu,
            layout=cfg.parallel.trainer_layout(),
            temperature=cfg.loop.rollout_temperature,
            grpo=cfg.loss,
            reference_model=cfg.loss.kl_coef > 0,
            total_steps=cfg.loop.optimizer_steps,
            routing_replay=replay,
        )
    )
    tok = processor.tokenizer
    try:
        engines = rollout_sglang.launch.engine_factory(
            cfg.rollout,
            source=source,
            use_gpu=lay.use_gpu,
            eos_token_ids=vlm_data.tokens.eos_token_ids(processor),
            pad_token_id=tok.pad_token_id or 0,
            min_pixels=d.min_pixels,
            max_pixels=d.max_pixels,
        )
    except ValueError as err:
        raise PreflightError(str(err)) from None
    if lay.colocate and lay.use_gpu:
        log.info(
            "trainer state %s the GPU during rollout, optimizer %.0f%% on the host (%s)",
            "leaves" if plan.offload_train else "stays on",
            100 * plan.optimizer_offload,
            plan.why,
        )
        if cfg.rollout.cache_tokens is not None:
            log.info("engine KV cache: %s tokens (%s)", f"{cfg.rollout.cache_tokens:,}", cache_from)
        if replay:
            log.info("routing replay: the trainer routes each token to the engine's experts")
    loop_cfg = dataclasses.replace(
        cfg.loop, use_ref_logprobs=cfg.loss.kl_coef > 0, offload_train=plan.offload_train
    )
    # SGLang sizes its KV pool from the GPU memory free when it starts: colocated, its engines
    # start first and release their memory before the trainers load (as slime does); the
    # transformers engine takes its cache at each rollout, so both load side by side
    engines_first = (
        lay.colocate and lay.use_gpu and rollout_sglang.launch.uses_sglang(cfg.rollout, lay.use_gpu)
    )
    with cfg.reward.build() as scorer, Cluster(cfg.cluster, lay) as cluster:
        train = None
        if not engines_first:
            train = cluster.train_group(
                trainer, actor_class, tp_size=cfg.parallel.tp_cp_size, wait=False
            )
        rollout = cluster.rollout_group(
            engines,
            request_fn=rollout_sglang.types.GenerateRequest.from_prompt,
            params_fn=rollout_sglang.types.SamplingParams,
            transport=transport,
        )
        if engines_first:
            rollout.release_memory()
            train = cluster.train_group(
                trainer, actor_class, tp_size=cfg.parallel.tp_cp_size, wait=False
            )
        train.ready()
        cluster.record(run_dir)
        logger = RunLogger(
            run_dir,
            wandb=cfg.run.use_wandb(os.environ),
            wandb_project=cfg.run.wandb_project,
            run_name=cfg.run.wandb_run_name,
            group=cfg.run.wandb_group,
            config=to_dict(cfg),
            resume_step=start_step,
        )
        parts = GrpoParts(
            train=train,
            rollout=rollout,
            train_prompts=train_prompts,
            eval_prompts=eval_prompts,
            decode=functools.partial(tok.decode, skip_special_tokens=True),
            score=scorer,
            logger=logger,
            checkpoints=checkpoints,
            resume=cfg.run.resume,
            offload_between_phases=lay.colocate and lay.use_gpu,
            engines_released=engines_first,
            forbidden_token_ids=frozenset(vlm_data.tokens.vision_token_ids(processor)),
            compute_dtype=compute_dtype(cfg, lay.use_gpu),
            gap_family=family,
        )
        rows = run_grpo(loop_cfg, parts)
        if parts.offload_between_phases and plan.offload_train:
            train.onload()
        train.export_hf(run_dir / "hf")
        processor.save_pretrained(run_dir / "hf")
        logger.close()
    for name, src in (("train", train_prompts), ("eval", eval_prompts)):
        if src is not None and src.skipped:
            log.warning("%s rows skipped, by reason: %s", name, dict(src.builder.stats))
    steps = sum(r.get("step", 0) > 0 for r in rows)  # step 0: the evaluation before the first
    log.info("GRPO done: %d steps; run folder %s", steps, run_dir)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    with user_errors("geo3k_grpo", argv, extra=(ModelSourceError,)):
        cfg = parse(argv)
        check(cfg)
        setup_logging(cfg.run.log_level)
        log.info("geo3k_grpo configuration:\n%s", to_json(cfg))
        run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
