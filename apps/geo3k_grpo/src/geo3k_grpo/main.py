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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from geo3k_sft.common import (
    ENV_ALIASES,
    DataSection,
    ModelSection,
    OptimSection,
    RowSource,
    RunSection,
    actor_cpus,
    build_processor,
    eos_token_ids,
    fsdp_config,
    layout,
    load_split,
    make_hf_engine,
    make_sglang_engine,
    model_source,
    optim_config,
    start_ray,
    trainer_factory,
    use_wandb,
    vision_token_ids,
    write_config,
)
from rl_runtime import (
    CheckpointManager,
    GrpoLoopConfig,
    GrpoParts,
    RolloutGroup,
    RunLogger,
    SftLoopConfig,
    TrainGroup,
    check_backend,
    check_gpus,
    option,
    parse_config,
    run_grpo,
    setup_logging,
    to_json,
)

log = logging.getLogger(__name__)


@dataclass
class RolloutSection:
    rollout_engine: Literal["auto", "sglang", "hf"] = option(
        "auto", "rollout engine; auto: SGLang on GPUs when installed, else transformers"
    )
    rollout_max_batch_size: int = option(64, "transformers engine: requests per forward batch")
    sglang_mem_fraction_static: float = option(0.6, "SGLang: GPU memory fraction for weights+KV")
    rollout_num_gpus_per_engine: int = option(1, "GPUs per rollout engine (SGLang tensor parallel)")
    sglang_mm_attention_backend: str | None = option(
        None, "SGLang vision attention kernel ('sdpa' on B200, where fa3 is missing)"
    )


@dataclass
class LossSection:
    eps_clip: float = option(0.2, "PPO clip range (lower)")
    eps_clip_high: float = option(0.28, "PPO clip range (upper, clip-higher)")
    kl_coef: float = option(0.0, "KL penalty coefficient (0: no KL, no reference model)")
    kl_type: str = option("low_var_kl", "KL estimator: low_var_kl | k1 | k2 | k3")
    entropy_coef: float = option(0.0, "entropy bonus coefficient")
    loss_agg_mode: str = option(
        "token-mean", "loss aggregation (token-mean | seq-mean-token-mean...)"
    )
    use_tis: bool = option(False, "truncated importance sampling against the rollout log-probs")
    reward_type: str = option("math", "reward: math | geo3k | math_format")
    reward_workers: int | None = option(None, "processes that score responses (default: cores)")


@dataclass
class WarmupSection:
    warmup_sft_steps: int = option(
        0, "without --load: SFT steps to run first (the tiny preset's format warm-up)"
    )
    warmup_sft_batch_size: int = option(32, "SFT warm-up batch size")
    warmup_sft_lr: float = option(3e-3, "SFT warm-up learning rate")


@dataclass
class Geo3kGrpoConfig:
    run: RunSection = field(default_factory=lambda: RunSection(output_dir="runs/geo3k_grpo"))
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    loop: GrpoLoopConfig = field(default_factory=GrpoLoopConfig)
    warmup: WarmupSection = field(default_factory=WarmupSection)


PRESETS: dict[str, dict[str, Any]] = {
    # A CPU run in minutes: a random-init tiny Qwen3-VL, the offline tiny processor and the
    # synthetic "what colour is the square" task. The warm-up teaches the answer format (greedy
    # answers are right, sampled ones mostly are not); GRPO then raises the sampled reward.
    "tiny": {
        "backend": "fsdp",
        "num_gpus": 0,
        "model_name": "qwen3-vl-tiny",
        "tokenizer": "tiny",
        "dataset": "synthetic:color",
        "template": "none",
        "attn_implementation": "sdpa",
        "output_dir": "runs/geo3k_grpo_tiny",
        "rollout_engine": "hf",
        "num_rollout": 30,
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "global_batch_size": 64,
        "rollout_temperature": 1.0,
        "rollout_max_response_len": 16,
        "eval_interval": 10,
        "eval_max_prompts": 32,
        "save_interval": 10,
        "lr": 5e-4,
        "weight_decay": 0.0,
        "reward_workers": 1,
        "warmup_sft_steps": 36,
        "warmup_sft_batch_size": 32,
        "warmup_sft_lr": 3e-3,
    },
}


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None):
    return parse_config(
        Geo3kGrpoConfig,
        argv,
        env=os.environ if env is None else env,
        env_aliases=ENV_ALIASES,
        presets=PRESETS,
        description=__doc__,
        prog="geo3k_grpo",
    )


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
    sft_cfg = Geo3kSftConfig(
        run=dataclasses.replace(cfg.run, output_dir=str(sft_dir), resume=True, load=None),
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
            raise SystemExit(
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
        base_gpu_id=0,  # Ray shows each engine only its own GPU(s)
        mm_attention_backend=cfg.rollout.sglang_mm_attention_backend,
    )


def uses_sglang(cfg: Geo3kGrpoConfig, use_gpu: bool) -> bool:
    kind = cfg.rollout.rollout_engine
    return kind == "sglang" or (kind == "auto" and use_gpu and _has_sglang())


def run(cfg: Geo3kGrpoConfig) -> list[dict[str, Any]]:
    check_gpus(cfg.run.num_gpus, preset=cfg.run.preset)
    check_backend(cfg.run.backend)
    run_dir = Path(cfg.run.output_dir)
    write_config(cfg, run_dir)
    if cfg.run.load is None and cfg.warmup.warmup_sft_steps > 0:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, load=warm_up(cfg, run_dir)))
    from rewards_math import BatchScorer
    from rl_algos import GrpoLossConfig
    from rollout_sglang import GenerateRequest, SamplingParams
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
        rows = load_split(d, split, eval_split=eval_split, seed=cfg.run.seed)
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
    actor_cfg = fsdp_config(
        cfg.model,
        cfg.run,
        source,
        optim_config(cfg.optim, cfg.loop.num_rollout * steps_per_rollout),
        temperature=cfg.loop.rollout_temperature,
        grpo=grpo,
        reference_model=loss.kl_coef > 0,
    )
    loop_cfg = dataclasses.replace(cfg.loop, use_ref_logprobs=loss.kl_coef > 0)
    lay = layout(cfg.run)
    ray_handle = start_ray(cfg.run, lay)
    scorer = BatchScorer(loss.reward_type, num_workers=loss.reward_workers)
    try:
        train = TrainGroup(
            trainer_factory(cfg.run, actor_cfg),
            world_size=lay.num_trainers,
            placement=ray_handle.placement,
            num_cpus=actor_cpus(lay),
        )
        ray_handle.actors.append(train)
        rollout = RolloutGroup(
            engine_factory(cfg, source, processor, lay.use_gpu),
            num_engines=lay.num_engines,
            placement=ray_handle.placement,
            request_fn=GenerateRequest.from_prompt,
            params_fn=SamplingParams,
            num_cpus=actor_cpus(lay),
            # Engines on GPUs of their own get weights over NCCL; colocated ones through Ray.
            transport=(
                "distributed"
                if uses_sglang(cfg, lay.use_gpu) and not lay.colocate
                else "object_store"
            ),
            ranks_per_engine=cfg.rollout.rollout_num_gpus_per_engine,
        )
        ray_handle.actors.append(rollout)
        checkpoints = CheckpointManager(
            run_dir / "checkpoints", keep_last=cfg.loop.keep_checkpoints
        )
        checkpoints.clean_partial()
        resume_step = None
        if cfg.run.resume:
            latest = checkpoints.latest()
            resume_step = latest[0] if latest else 0
            if latest is None:
                log.warning("--resume: no complete checkpoint in %s; starting fresh", run_dir)
        logger = RunLogger(
            run_dir,
            wandb=use_wandb(cfg.run, os.environ),
            wandb_project=cfg.run.wandb_project,
            config=json.loads(to_json(cfg)),
            resume_step=resume_step,
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
    cfg = parse(argv)
    setup_logging(cfg.run.log_level)
    log.info("geo3k_grpo configuration:\n%s", to_json(cfg))
    run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
