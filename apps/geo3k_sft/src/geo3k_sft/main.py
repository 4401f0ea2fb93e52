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

from geo3k_sft.config import ENV_ALIASES, PRESETS, Geo3kSftConfig, parse
from rl_runtime import (
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

__all__ = ["PRESETS", "Geo3kSftConfig", "check", "main", "parse", "run"]

log = logging.getLogger(__name__)

DATASET = f"--dataset / {ENV_ALIASES['dataset'][0]}"  # how a dataset error names the setting
OUTPUT_DIR = f"--output-dir / {ENV_ALIASES['output_dir'][0]}"


def check(cfg: Geo3kSftConfig) -> None:
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


def run(cfg: Geo3kSftConfig) -> Path:
    """Settle the model and layout, build the samples and the trainer, train; return the
    exported HF folder."""
    import vlm_data.sources  # torch, Ray, transformers: imported once the flags are checked
    import vlm_data.tokens
    import vlm_models.sources
    from geo3k_sft.config import ACTORS, other_trainers
    from rl_runtime import (
        CheckpointManager,
        check_backend,
        resume_step,
        settle,
        to_dict,
        train_sft,
        write_config,
    )

    actor_class = ACTORS[cfg.run.backend]
    check_backend(cfg.run.backend, cfg.trainer, actor_class, use_gpu=cfg.cluster.use_gpu)
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
    with as_config_error(DatasetLoadError, DATASET):
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
        actor_class=actor_class,
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
        check(cfg)
        setup_logging(cfg.run.log_level)
        log.info("geo3k_sft configuration:\n%s", to_json(cfg))
        run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
