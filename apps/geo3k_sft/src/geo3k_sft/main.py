"""`uv run apps/geo3k_sft`: supervised fine-tuning on Geometry3K-style rows.

`main` parses the configuration (`config.py`); `run` builds the parts from it, each with its
package's own function, and hands them to `rl_runtime.train_sft`. The run folder ends with
`hf/`, which `uv run apps/geo3k_grpo --load <run folder>` starts from.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import vlm_data
import vlm_data.sources
import vlm_data.tokens
import vlm_models
import vlm_models.sources
from geo3k_sft.config import ENV_ALIASES, PRESETS, Geo3kSftConfig, other_trainers, parse
from rl_runtime import (
    CheckpointManager,
    RunContext,
    as_config_error,
    check_backend,
    resume_step,
    settle,
    setup_logging,
    to_dict,
    to_json,
    train_sft,
    user_errors,
    write_config,
)
from vlm_data.loading import DatasetLoadError
from vlm_models import ModelSourceError

__all__ = ["PRESETS", "Geo3kSftConfig", "main", "parse", "run"]

log = logging.getLogger(__name__)


def run(cfg: Geo3kSftConfig) -> Path:
    """Settle the model and layout, build the samples and the trainer, train; return the
    exported HF folder."""
    check_backend(cfg.run.backend, cfg.trainer, use_gpu=cfg.cluster.use_gpu)
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
        with_engines=False,
    )
    cfg = dataclasses.replace(cfg, model=model, parallel=parallel)
    run_dir = Path(cfg.run.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.sft.sft_keep_checkpoints)
    start_step = resume_step(checkpoints, run_dir) if cfg.run.resume else None
    write_config(cfg, run_dir)
    processor = vlm_data.sources.load_processor(
        vlm_models.sources.processor_source(cfg.model, load=load), cfg.data
    )
    with as_config_error(DatasetLoadError, f"--dataset / {ENV_ALIASES['dataset'][0]}"):
        samples = vlm_data.sources.sft_source(cfg.data, processor, seed=cfg.run.seed)
    token_ids = vlm_data.tokens.model_token_ids(processor)
    vlm_models.sources.check_token_ids(cfg.model, token_ids, load=load)
    source = vlm_models.sources.model_source(cfg.model, load=load, token_ids=token_ids)
    trainer = cfg.trainer.for_run(
        RunContext(
            model=source,
            seed=cfg.run.seed,
            use_gpu=cfg.cluster.use_gpu,
            layout=cfg.parallel.trainer_layout(),
            total_steps=cfg.sft.sft_num_steps,
        )
    )
    return train_sft(
        cfg.sft,
        run=cfg.run,
        cluster=cfg.cluster,
        trainer=trainer,
        samples=samples,
        tp_size=cfg.parallel.tp_cp_size,
        config=to_dict(cfg),
        start_step=start_step,
        on_export=processor.save_pretrained,
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    with user_errors("geo3k_sft", argv, extra=(ModelSourceError,)):
        cfg = parse(argv)
        setup_logging(cfg.run.log_level)
        log.info("geo3k_sft configuration:\n%s", to_json(cfg))
        run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
