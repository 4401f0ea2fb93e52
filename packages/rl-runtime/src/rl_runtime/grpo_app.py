"""One entry point for a GRPO run: a recipe (`GrpoRecipe`: its config, presets, dataset source,
prompt building, reward, trainers and rollout engine package) in, a trained run folder out.

`run` settles the model and the layout before Ray, plans colocation, picks the weight
transport, builds the data and the trainer, starts engines and trainer ranks in the order the
engine needs, and hands them to the loop (`rl_runtime.run_grpo`); then exports the weights.
Without `--load` and with `--warmup-sft-steps`, a short SFT warm-up runs first (`warm_up`).

    RECIPE = GrpoRecipe(name="my_grpo", config=MyConfig, trainers=TRAINERS, engines=engines,
                        rows=my_rows, reward=my_reward, presets=PRESETS)
    RECIPE.main()   # a launcher: flags, checks, the run
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards_math import RewardConfig
from rl_algos import GrpoLossConfig
from rl_runtime.cluster_config import ClusterConfig, layout
from rl_runtime.config_fields import ConfigError, section
from rl_runtime.grpo_plan import (
    colocation_plan,
    compute_dtype,
    longest_sample,
    print_layout,
    rollout_config,
)
from rl_runtime.loop_config import GrpoLoopConfig
from rl_runtime.parallel_config import ParallelConfig, check_parallel
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import EngineLauncher
from rl_runtime.recipe import (
    Builder,
    Recipe,
    load_processor,
    model_source,
    prompt_builder,
    trainer_for,
)
from rl_runtime.run import RunConfig
from rl_runtime.sft_config import WarmupConfig
from vlm_data import DataConfig
from vlm_models import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class GrpoConfig:
    """The sections of every GRPO run. A recipe subclasses it with its rollout package's section
    and its trainers' choice, which take the places kept for them here:

        @dataclass
        class MyConfig(GrpoConfig):
            rollout: RolloutConfig = section(RolloutConfig)
            trainer: FsdpConfig | MegatronConfig = choice(TRAINERS, by="backend")
    """

    run: RunConfig = section(RunConfig)
    cluster: ClusterConfig = section(ClusterConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    rollout: Any = None  # the recipe's: its rollout package's config
    loss: GrpoLossConfig = section(GrpoLossConfig)
    reward: RewardConfig = section(RewardConfig)
    trainer: Any = None  # the recipe's: choice(trainers, by="backend")
    loop: GrpoLoopConfig = section(GrpoLoopConfig)
    warmup: WarmupConfig = section(
        WarmupConfig,
        "the SFT warm-up before GRPO (without --load): its own steps, batch and constant "
        "learning rate; the trainer section's --lr, --lr-schedule, --lr-warmup-steps and "
        "--min-lr are the GRPO steps'",
    )

    def check(self) -> None:
        self.run = self.run.with_wandb_names(self.model.model_name)  # shown by --print-config
        # a KL penalty keeps a frozen reference model: the memory plan counts it from here on
        # (set in place: dataclasses.replace would run the trainer's __post_init__ checks, which
        # need what for_run adds, such as a cosine schedule's total_steps)
        self.trainer.reference_model = self.loss.kl_coef > 0
        try:
            check_parallel(self.trainer, self.parallel, self.cluster)
            if self.rollout.backend != "hf":  # SGLang engines of N GPUs take N rollout GPUs
                layout(self.cluster, gpus_per_engine=self.rollout.tp_size)
        except (ConfigError, PreflightError) as err:
            if self.run.preset is None:
                raise
            raise ConfigError(
                f"{err} (--preset {self.run.preset} sets this layout: {preset_layout(self)})"
            ) from None


def preset_layout(cfg: GrpoConfig) -> str:
    """A preset's layout settings as flags, for a refusal's message."""
    p, r = cfg.parallel, cfg.rollout
    parts = [f"--backend {cfg.run.backend}", f"--num-gpus {cfg.cluster.num_gpus}"]
    parts += [f"--tensor-parallel {p.tensor_parallel}"] * bool(p.tensor_parallel)
    parts += [f"--expert-parallel {p.expert_parallel}"] * (p.expert_parallel > 1)
    if p.expert_tensor_parallel is not None:
        parts.append(f"--expert-tensor-parallel {p.expert_tensor_parallel}")
    parts += [f"--rollout-num-gpus-per-engine {r.tp_size}"] * (r.tp_size > 1)
    return " ".join(parts)


@dataclass(frozen=True)
class Engines:
    """A rollout engine package as a GRPO run uses it (rollout_sglang: its `launch` module,
    `types.GenerateRequest.from_prompt` and `types.SamplingParams`)."""

    launch: EngineLauncher
    request_fn: Callable[[Any], Any]  # a prompt -> the engine's request
    params_fn: Callable[..., Any]  # sampling settings -> the engine's parameters


def config_reward(cfg: Any) -> Any:
    """The reward `--reward-type` names (rewards-math's `BatchScorer`)."""
    return cfg.reward.build()


@dataclass(frozen=True, kw_only=True)
class GrpoRecipe(Recipe):
    """What a GRPO recipe chooses, beside `Recipe`'s: its rollout engine package, imported when
    a run starts; how a row becomes a rollout prompt; the reward, `(cfg) -> scorer`, where a
    scorer maps `(responses, answers)` to scores and is closed at the end (`with`), such as
    `rewards_math.BatchScorer(my_fn)` over a `(response, label) -> float` function."""

    engines: Callable[[], Engines]
    prompts: Builder = prompt_builder
    reward: Callable[[Any], Any] = config_reward

    def print_extra(self, cfg: Any) -> Mapping[str, Any]:
        others = self.other_trainers(cfg.run.backend)
        return print_layout(cfg, engines=self.engines().launch, others=others)

    def run(self, cfg: Any) -> list[dict[str, Any]]:
        return run(cfg, self)


def warm_up(cfg: Any, recipe: Recipe) -> Path:
    """A short SFT run, so that a random model learns the answer format; GRPO loads its folder."""
    from rl_runtime.config import to_dict
    from rl_runtime.sft import sft_warmup

    processor = load_processor(cfg, None)
    w = cfg.warmup
    trainer = trainer_for(
        cfg,
        model_source(cfg, processor, None),
        total_steps=w.warmup_sft_steps,
        schedule=w.schedule(),
    )
    return sft_warmup(
        w,
        run=cfg.run,
        cluster=cfg.cluster,
        trainer=trainer,
        actor_class=recipe.actor_class(cfg.run.backend),
        samples=lambda: recipe.sft_source(cfg, processor),
        tp_size=cfg.parallel.tp_cp_size,
        config=to_dict(cfg),
        on_export=processor.save_pretrained,
    )


def run(cfg: Any, recipe: GrpoRecipe) -> list[dict[str, Any]]:
    """Settle the model and layout, build the data, trainer, engines and Ray, then train."""
    import vlm_data.tokens  # torch, Ray, transformers: imported once the flags are checked
    from rl_runtime.checkpoint import CheckpointManager, resume_step
    from rl_runtime.cluster import Cluster
    from rl_runtime.config import to_dict
    from rl_runtime.logprob_guard import LINEAR_ATTENTION
    from rl_runtime.loop import GrpoParts, run_grpo
    from rl_runtime.loop_config import routing_replay_on
    from rl_runtime.metrics import RunLogger
    from rl_runtime.preflight import check_backend
    from rl_runtime.run import write_config
    from vlm_models.sources import shape_of

    engines = recipe.engines()
    launch = engines.launch
    actor_class = recipe.actor_class(cfg.run.backend)
    check_backend(cfg.run.backend, cfg.trainer, actor_class, use_gpu=cfg.cluster.use_gpu)
    lay = layout(cfg.cluster, gpus_per_engine=cfg.rollout.tp_size)
    try:  # colocated on a GPU: CUDA IPC; SGLang on GPUs of its own: NCCL; else Ray's store
        launch.check_engines(cfg.rollout, use_gpu=lay.use_gpu)
        kw = {"colocate": lay.colocate, "use_gpu": lay.use_gpu, "num_trainers": lay.num_trainers}
        # --weight-transport disk writes the buckets where the run's files are, to inspect
        disk_folder = str((Path(cfg.run.output_dir) / "weight-sync").resolve())
        transport = launch.weight_transport(cfg.rollout, **kw, disk_folder=disk_folder)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    load = cfg.run.load
    free = cfg.parallel.offload_options  # optimizer fractions the user left to the launcher
    cfg = recipe.settle(
        cfg,
        longest_sample=longest_sample(cfg),
        engines_park_weights=cfg.rollout.weights_cpu_backup,
    )
    # colocated: the trainer's state during rollout, which may put more of the optimizer on
    # the host (a host too small to take the state for each rollout)
    plan = colocation_plan(cfg, free, engines=launch)
    if plan.optimizer_offload != cfg.parallel.offload_fraction:  # said with the plan, below
        parallel = cfg.parallel.with_optimizer_offload(plan.optimizer_offload)
        cfg = dataclasses.replace(cfg, parallel=parallel)
    # the transformers engine's KV cache in tokens: the plan's, unless --rollout-cache-tokens
    cache_from = "planned" if cfg.rollout.cache_tokens is None else "--rollout-cache-tokens"
    # MoE: the trainer routes each token to the engine's experts (--routing-replay)
    shape = shape_of(cfg.model, load=load) or {}
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
        load = str(warm_up(cfg, recipe))
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, load=load))

    processor = load_processor(cfg, load)
    d = cfg.data
    train_prompts = recipe.source(cfg, recipe.prompts(cfg, processor), d.train_split)
    eval_prompts = None
    if cfg.loop.eval_interval:
        builder = recipe.prompts(cfg, processor)
        eval_prompts = recipe.source(cfg, builder, d.eval_split, eval_split=True)
    source = model_source(cfg, processor, load)
    trainer = trainer_for(
        cfg,
        source,
        temperature=cfg.loop.rollout_temperature,
        grpo=cfg.loss,
        reference_model=cfg.loss.kl_coef > 0,
        total_steps=cfg.loop.optimizer_steps,
        routing_replay=replay,
    )
    tok = processor.tokenizer
    try:
        factory = launch.engine_factory(
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
    if replay:  # on any layout (docs/reliability.md: the log says so when it is on)
        log.info("routing replay: the trainer routes each token to the engine's experts")
    loop_cfg = dataclasses.replace(
        cfg.loop, use_ref_logprobs=cfg.loss.kl_coef > 0, offload_train=plan.offload_train
    )
    # SGLang sizes its KV pool from the GPU memory free when it starts: colocated, its engines
    # start first and release their memory before the trainers load (as slime does); the
    # transformers engine takes its cache at each rollout, so both load side by side
    engines_first = lay.colocate and lay.use_gpu and launch.uses_sglang(cfg.rollout, lay.use_gpu)
    tp_size = cfg.parallel.tp_cp_size
    with recipe.reward(cfg) as scorer, Cluster(cfg.cluster, lay) as cluster:
        train = None
        if not engines_first:
            train = cluster.train_group(trainer, actor_class, tp_size=tp_size, wait=False)
        rollout = cluster.rollout_group(
            factory,
            request_fn=engines.request_fn,
            params_fn=engines.params_fn,
            transport=transport,
        )
        if engines_first:
            rollout.release_memory()
            train = cluster.train_group(trainer, actor_class, tp_size=tp_size, wait=False)
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
