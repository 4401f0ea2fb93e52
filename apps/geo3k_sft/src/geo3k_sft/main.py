"""`uv run apps/geo3k_sft`: supervised fine-tuning on Geometry3K-style rows.

The assistant reply is the recipe's `Answer: \\boxed{<answer>}` (or the row's own `messages`);
the loss covers assistant tokens only. The run folder ends with `hf/`, an HF model folder with
the processor beside it, which `uv run apps/geo3k_grpo --load <run folder>` starts from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geo3k_sft.common import (
    ENV_ALIASES,
    TINY_RUN,
    DataSection,
    ModelSection,
    OptimSection,
    RowSource,
    RunSection,
    actor_config,
    build_processor,
    check_backend_options,
    layout,
    load_split,
    model_source,
    start_ray,
    train_group,
    use_wandb,
    write_config,
)
from geo3k_sft.preflight import layout_report, prepare_model
from rl_runtime import (
    CheckpointManager,
    RunLogger,
    SftLoopConfig,
    check_backend,
    parse_config,
    resume_step,
    run_sft,
    setup_logging,
    to_json,
    user_errors,
)

log = logging.getLogger(__name__)


@dataclass
class Geo3kSftConfig:
    run: RunSection = field(default_factory=lambda: RunSection(output_dir="runs/geo3k_sft"))
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=lambda: DataSection(template="none"))
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5))
    sft: SftLoopConfig = field(default_factory=SftLoopConfig)

    def check(self) -> None:
        check_backend_options(self.run, self.model)


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **TINY_RUN,
        "output_dir": "runs/geo3k_sft_tiny",
        "lr": 3e-3,
        "weight_decay": 0.0,
        "sft_num_steps": 36,
        "sft_batch_size": 32,
        "sft_save_interval": 12,
    },
}


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None):
    return parse_config(
        Geo3kSftConfig,
        argv,
        env=os.environ if env is None else env,
        env_aliases=ENV_ALIASES,
        presets=PRESETS,
        description=__doc__,
        prog="geo3k_sft",
        print_extra=lambda cfg: {"layout": layout_report(cfg.model, cfg.run, with_engines=False)},
    )


def run(cfg: Geo3kSftConfig) -> Path:
    """Train; return the exported HF folder."""
    check_backend(cfg.run.backend)
    model = prepare_model(cfg.model, cfg.run, with_engines=False)
    cfg = dataclasses.replace(cfg, model=model)
    run_dir = Path(cfg.run.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.sft.sft_keep_checkpoints)
    start_step = resume_step(checkpoints, run_dir) if cfg.run.resume else None
    write_config(cfg, run_dir)
    processor = build_processor(cfg.model, cfg.run, cfg.data)
    from vlm_data import SftSampleBuilder

    builder = SftSampleBuilder(
        processor,
        template=cfg.data.template,
        max_length=cfg.data.max_prompt_length,
        prompt_key=cfg.data.prompt_key,
        answer_key=cfg.data.answer_key,
        image_key=cfg.data.image_key,
    )
    rows = load_split(cfg.data, cfg.data.train_split, seed=cfg.run.seed, stats=builder.stats)
    samples = RowSource(rows, builder)
    source = model_source(cfg.model, cfg.run, processor)
    actor_cfg = actor_config(cfg.model, cfg.run, source, cfg.optim, cfg.sft.sft_num_steps)
    lay = layout(cfg.run, with_engines=False)
    ray_handle = start_ray(cfg.run, lay)
    try:
        train = train_group(cfg.run, cfg.model, actor_cfg, lay, ray_handle)
        logger = RunLogger(
            run_dir,
            wandb=use_wandb(cfg.run, os.environ),
            wandb_project=cfg.run.wandb_project,
            config=_flat(cfg),
            resume_step=start_step,
        )
        checkpoints.clean_partial()
        export = run_dir / "hf"
        run_sft(
            cfg.sft,
            train=train,
            samples=samples,
            logger=logger,
            checkpoints=checkpoints,
            export_dir=export,
            resume=cfg.run.resume,
        )
        processor.save_pretrained(export)
        logger.close()
        log.info("SFT done: %d rows skipped; weights in %s", samples.skipped, export)
        return export
    finally:
        ray_handle.close()


def _flat(cfg: Any) -> dict[str, Any]:
    import json

    return json.loads(to_json(cfg))


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    with user_errors("geo3k_sft", argv):
        cfg = parse(argv)
        setup_logging(cfg.run.log_level)
        log.info("geo3k_sft configuration:\n%s", to_json(cfg))
        run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
