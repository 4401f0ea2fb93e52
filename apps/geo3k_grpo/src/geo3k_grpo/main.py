"""`uv run apps/geo3k_grpo`: GRPO on Geometry3K (the miles / slime geo3k VLM recipe).

Defaults are the recipe's: 64 prompts x 8 samples per rollout, global batch 512, temperature
0.8, responses up to 4096 tokens, eps_clip 0.2 / 0.28, no KL, lr 1e-6 constant, Adam betas
0.9 / 0.98, weight decay 0.1, the math reward, evaluation every 20 steps on the test split.
`--preset tiny` runs the whole thing on a CPU in minutes (with a short SFT warm-up first).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geo3k_grpo.config import PRESETS, Geo3kGrpoConfig, parse, reward_options
from geo3k_sft.common import (
    RowSource,
    actor_config,
    actor_cpus,
    build_processor,
    eos_token_ids,
    layout,
    load_split,
    make_hf_engine,
    make_sglang_engine,
    model_source,
    start_ray,
    train_group,
    use_wandb,
    vision_token_ids,
    write_config,
)
from geo3k_sft.preflight import prepare_model
from rl_runtime import (
    CheckpointManager,
    GrpoParts,
    PreflightError,
    RolloutGroup,
    RunLogger,
    SftLoopConfig,
    check_backend,
    resume_step,
    run_grpo,
    setup_logging,
    to_json,
    user_errors,
)

__all__ = ["PRESETS", "Geo3kGrpoConfig", "main", "parse", "run"]

log = logging.getLogger(__name__)


def warm_up(cfg: Geo3kGrpoConfig, run_dir: Path) -> str:
    """Run the SFT app's code for a few steps so that a random model learns the answer format;
    return the folder GRPO starts from. Reused when a finished warm-up is already there."""
    from geo3k_sft.main import Geo3kSftConfig
    from geo3k_sft.main import run as run_sft_app

    sft_dir = run_dir / "sft_warmup"
    if (sft_dir / "hf" / "config.json").is_file():
        log.info("reusing the SFT warm-up in %s", sft_dir)
        return str(sft_dir)
    w = cfg.warmup
    log.info(
        "no --load given: running a short SFT warm-up first (%d steps, through the SFT app) so "
        "that the random model learns the answer format; then GRPO starts from it",
        w.warmup_sft_steps,
    )
    # Resume only a warm-up that left a checkpoint: one killed before it starts over.
    resume = CheckpointManager(sft_dir / "checkpoints").latest() is not None
    sft_cfg = Geo3kSftConfig(
        run=dataclasses.replace(cfg.run, output_dir=str(sft_dir), resume=resume, load=None),
        model=cfg.model,
        data=cfg.data,
        optim=dataclasses.replace(cfg.optim, lr=w.warmup_sft_lr),
        sft=SftLoopConfig(
            sft_num_steps=w.warmup_sft_steps,
            sft_batch_size=w.warmup_sft_batch_size,
            sft_save_interval=0,
            sft_seed=cfg.run.seed,
        ),
    )
    run_sft_app(sft_cfg)
    return str(sft_dir)


def engine_factory(cfg: Geo3kGrpoConfig, source: Any, processor: Any, use_gpu: bool) -> Any:
    kind = cfg.rollout.rollout_engine
    if kind == "auto":
        kind = "sglang" if use_gpu and _has_sglang() else "hf"
    if kind == "sglang":
        if not _has_sglang():
            raise PreflightError(
                "--rollout-engine sglang: SGLang is not installed (uv sync --extra gpu)"
            )
        return functools.partial(make_sglang_engine, _sglang_config(cfg, source))
    tok = processor.tokenizer
    return functools.partial(
        make_hf_engine,
        source,
        eos_token_ids(processor),
        tok.pad_token_id or 0,
        cfg.rollout.rollout_max_batch_size,
    )


def _has_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def _sglang_config(cfg: Geo3kGrpoConfig, source: Any) -> Any:
    from rollout_sglang import RolloutConfig

    if not isinstance(source, str):
        raise SystemExit("the SGLang engine needs a model folder or hub id (use --load or a name)")
    return RolloutConfig(
        model_path=source,
        backend="sglang",
        tp_size=cfg.rollout.rollout_num_gpus_per_engine,
        mem_fraction_static=cfg.rollout.sglang_mem_fraction_static,
        base_gpu_id=0,  # an engine sees only its own GPU(s): Ray or its worker set them
        mm_attention_backend=cfg.rollout.sglang_mm_attention_backend,
        # the prompt processor's bounds, so SGLang expands each image to the same token count
        min_pixels=cfg.data.min_pixels,
        max_pixels=cfg.data.max_pixels,
    )


def engine_layout(lay: Any, gpus_per_engine: int) -> Any:
    """One engine per ``gpus_per_engine`` rollout GPUs (SGLang tensor parallel)."""
    if not lay.use_gpu or gpus_per_engine == 1:
        return lay
    if lay.num_engines % gpus_per_engine:
        raise SystemExit(
            f"--rollout-num-gpus-per-engine {gpus_per_engine} does not divide the "
            f"{lay.num_engines} rollout GPUs"
        )
    return dataclasses.replace(
        lay, num_engines=lay.num_engines // gpus_per_engine, gpus_per_engine=gpus_per_engine
    )


def uses_sglang(cfg: Geo3kGrpoConfig, use_gpu: bool) -> bool:
    kind = cfg.rollout.rollout_engine
    return kind == "sglang" or (kind == "auto" and use_gpu and _has_sglang())


def run(cfg: Geo3kGrpoConfig) -> list[dict[str, Any]]:
    check_backend(cfg.run.backend)
    rewards = reward_options(cfg.loss)
    cfg = dataclasses.replace(cfg, model=prepare_model(cfg.model, cfg.run))
    run_dir = Path(cfg.run.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.loop.keep_checkpoints)
    start_step = resume_step(checkpoints, run_dir) if cfg.run.resume else None
    write_config(cfg, run_dir)
    if cfg.run.load is None and cfg.warmup.warmup_sft_steps > 0:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, load=warm_up(cfg, run_dir)))
    from rewards_math import BatchScorer
    from rl_algos import GrpoLossConfig
    from rollout_sglang import GenerateRequest, SamplingParams, choose_weight_transport
    from vlm_data import PromptBuilder

    processor = build_processor(cfg.model, cfg.run, cfg.data)
    d = cfg.data

    def prompts(split: str, eval_split: bool) -> RowSource:
        builder = PromptBuilder(
            processor,
            template=d.template,
            max_prompt_length=d.max_prompt_length,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            image_key=d.image_key,
        )
        rows = load_split(d, split, eval_split=eval_split, seed=cfg.run.seed, stats=builder.stats)
        return RowSource(rows, builder)

    train_prompts = prompts(d.train_split, False)
    eval_prompts = prompts(d.eval_split, True) if cfg.loop.eval_interval else None
    source = model_source(cfg.model, cfg.run, processor)
    loss = cfg.loss
    grpo = GrpoLossConfig(
        eps_clip=loss.eps_clip,
        eps_clip_high=loss.eps_clip_high,
        kl_coef=loss.kl_coef,
        kl_type=loss.kl_type,
        entropy_coef=loss.entropy_coef,
        loss_agg_mode=loss.loss_agg_mode,
        use_tis=loss.use_tis,
    )
    steps_per_rollout = max(
        1, cfg.loop.rollout_batch_size * cfg.loop.n_samples_per_prompt // cfg.loop.global_batch_size
    )
    actor_cfg = actor_config(
        cfg.model,
        cfg.run,
        source,
        cfg.optim,
        cfg.loop.num_rollout * steps_per_rollout,
        temperature=cfg.loop.rollout_temperature,
        grpo=grpo,
        reference_model=loss.kl_coef > 0,
    )
    loop_cfg = dataclasses.replace(cfg.loop, use_ref_logprobs=loss.kl_coef > 0)
    lay = engine_layout(layout(cfg.run), cfg.rollout.rollout_num_gpus_per_engine)
    try:  # colocated on a GPU: CUDA IPC; SGLang on GPUs of its own: NCCL; else Ray's store
        transport = choose_weight_transport(
            colocate=lay.colocate,
            use_gpu=lay.use_gpu,
            sglang=uses_sglang(cfg, lay.use_gpu),
            num_trainers=lay.num_trainers,
            ranks_per_engine=cfg.rollout.rollout_num_gpus_per_engine,
            kind=cfg.rollout.weight_transport,
        )
    except ValueError as err:
        raise PreflightError(f"--weight-transport {cfg.rollout.weight_transport}: {err}") from None
    ray_handle = start_ray(cfg.run, lay)
    scorer = BatchScorer(loss.reward_type, num_workers=loss.reward_workers, **rewards)
    try:
        train = train_group(cfg.run, cfg.model, actor_cfg, lay, ray_handle)
        rollout = RolloutGroup(
            engine_factory(cfg, source, processor, lay.use_gpu),
            num_engines=lay.num_engines,
            placement=ray_handle.placement,
            request_fn=GenerateRequest.from_prompt,
            params_fn=SamplingParams,
            num_cpus=actor_cpus(lay),
            transport=transport,
        )
        ray_handle.actors.append(rollout)
        logger = RunLogger(
            run_dir,
            wandb=use_wandb(cfg.run, os.environ),
            wandb_project=cfg.run.wandb_project,
            config=json.loads(to_json(cfg)),
            resume_step=start_step,
        )
        tokenizer = processor.tokenizer
        parts = GrpoParts(
            train=train,
            rollout=rollout,
            train_prompts=train_prompts,
            eval_prompts=eval_prompts,
            decode=functools.partial(tokenizer.decode, skip_special_tokens=True),
            score=scorer,
            logger=logger,
            checkpoints=checkpoints,
            resume=cfg.run.resume,
            offload_between_phases=lay.colocate and lay.use_gpu,
            forbidden_token_ids=frozenset(vision_token_ids(processor)),
        )
        rows = run_grpo(loop_cfg, parts)
        if parts.offload_between_phases:
            train.onload()
        train.export_hf(run_dir / "hf")
        processor.save_pretrained(run_dir / "hf")
        logger.close()
        for name, src in (("train", train_prompts), ("eval", eval_prompts)):
            if src is not None and src.skipped:
                log.warning("%s rows skipped, by reason: %s", name, dict(src.builder.stats))
        log.info("GRPO done: %d steps; run folder %s", len(rows), run_dir)
        return rows
    finally:
        scorer.close()
        ray_handle.close()


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    with user_errors("geo3k_grpo", argv):
        cfg = parse(argv)
        setup_logging(cfg.run.log_level)
        log.info("geo3k_grpo configuration:\n%s", to_json(cfg))
        run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
