"""One entry point for an SFT run: a recipe (`SftRecipe`: its config, presets, dataset source,
how a row becomes an SFT sample, its trainers) in, a run folder with `hf/` out, which a GRPO
recipe's `--load` starts from. `run` settles the model and the layout before Ray, builds the
samples and the trainer, and trains (`rl_runtime.train_sft`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_runtime.cluster_config import ClusterConfig, layout
from rl_runtime.config_fields import section
from rl_runtime.parallel import layout_report
from rl_runtime.parallel_config import ParallelConfig, check_parallel
from rl_runtime.recipe import Recipe, load_processor, model_source, trainer_for
from rl_runtime.run import RunConfig
from rl_runtime.sft_config import SftLoopConfig
from vlm_data import DataConfig
from vlm_models import ModelConfig


@dataclass
class SftConfig:
    """The sections of every SFT run; a recipe subclasses it with its trainers' choice, which
    takes the place kept for it here (`trainer: FsdpConfig | MegatronConfig =
    choice(TRAINERS, by="backend")`)."""

    run: RunConfig = section(RunConfig)
    cluster: ClusterConfig = section(ClusterConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    trainer: Any = None  # the recipe's: choice(trainers, by="backend")
    sft: SftLoopConfig = section(SftLoopConfig)

    def check(self) -> None:
        self.run = self.run.with_wandb_names(self.model.model_name)  # shown by --print-config
        check_parallel(self.trainer, self.parallel, self.cluster, with_engines=False)


@dataclass(frozen=True, kw_only=True)
class SftRecipe(Recipe):
    """What an SFT recipe chooses: `Recipe`'s fields (`sft_samples` builds its samples)."""

    def print_extra(self, cfg: Any) -> Mapping[str, Any]:
        """`--print-config`'s training layout and its memory estimate (no engines)."""
        from vlm_models.sources import shape_of  # transformers: only when asked

        report = layout_report(
            cfg.parallel,
            cfg.cluster,
            backend=cfg.run.backend,
            trainer=cfg.trainer,
            others=self.other_trainers(cfg.run.backend),
            shape=shape_of(cfg.model, load=cfg.run.load) if cfg.cluster.use_gpu else None,
            model_name=cfg.model.model_name,
            with_engines=False,
        )
        if cfg.cluster.ray_to_join is None:  # where each actor goes: only on a cluster
            return {"layout": report}
        from rl_runtime.cluster import placement_preview  # Ray

        lay = layout(cfg.cluster, with_engines=False)
        return {"layout": report, "placement": placement_preview(cfg.cluster, lay)}

    def run(self, cfg: Any) -> Path:
        return run(cfg, self)


def run(cfg: Any, recipe: Recipe) -> Path:
    """Settle the model and layout, build the samples and the trainer, train; return the
    exported HF folder."""
    from rl_runtime.checkpoint import CheckpointManager, resume_step
    from rl_runtime.config import to_dict
    from rl_runtime.preflight import check_backend
    from rl_runtime.run import write_config
    from rl_runtime.sft import train_sft

    actor_class = recipe.actor_class(cfg.run.backend)
    check_backend(cfg.run.backend, cfg.trainer, actor_class, use_gpu=cfg.cluster.use_gpu)
    load = cfg.run.load
    cfg = recipe.settle(cfg, with_engines=False)
    run_dir = Path(cfg.run.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.sft.sft_keep_checkpoints)
    start_step = resume_step(checkpoints, run_dir) if cfg.run.resume else None
    write_config(cfg, run_dir)
    processor = load_processor(cfg, load)
    samples = recipe.sft_source(cfg, processor)
    source = model_source(cfg, processor, load)
    trainer = trainer_for(cfg, source, total_steps=cfg.sft.sft_num_steps)
    return train_sft(
        cfg.sft,
        run=cfg.run,
        cluster=cfg.cluster,
        trainer=trainer,
        actor_class=actor_class,
        samples=samples,
        tp_size=cfg.parallel.tp_cp_size,
        config=to_dict(cfg),
        start_step=start_step,
        on_export=processor.save_pretrained,
    )
