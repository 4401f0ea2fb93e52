"""A recipe: what a run chooses (its config, presets, the dataset source, how a row becomes a
prompt or an SFT sample, the reward, and the backends), handed to one entry point that does
the rest: `rl_runtime.grpo_app.GrpoRecipe` and `rl_runtime.sft_app.SftRecipe`, whose
`main(argv)` is a whole launcher (`apps/geo3k_grpo`, `examples/jsonl_math/recipe.py`).

rl-runtime names no backend: a recipe hands in its trainer configs (`--backend`'s choices) and,
for GRPO, its rollout engine package. The model and its processor come from vlm-models and
vlm-data, as do the default data hooks. Importing this module loads neither torch nor Ray:
a launcher parses and refuses its flags first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_algos.run_context import RunContext
from rl_runtime.checkpoint import check_resume
from rl_runtime.cli import as_config_error, user_errors
from rl_runtime.config import parse_config, to_json
from rl_runtime.parallel import settle
from rl_runtime.preflight import check_gpus, check_output_dir
from rl_runtime.progress import setup_logging
from rl_runtime.protocols import ActorClass, TrainerConfig
from vlm_data.paths import DatasetLoadError, check_dataset
from vlm_models import ModelSourceError
from vlm_models.hub import check_model

log = logging.getLogger(__name__)

#: The dataset source: `(cfg, split, *, eval_split, stats) -> rows` (a list of dicts will do);
#: `stats` is the builder's counter, for rows lost at load (`stats["malformed_line"] += 1`).
Rows = Callable[..., Sequence[Mapping[str, Any]]]
#: Prompt building: `(cfg, processor) -> builder`, whose `maybe_build(row, index)` gives the
#: sample or None (a bad row, logged and counted in its `stats`): `vlm_data.prompts.PromptBuilder`,
#: `vlm_data.sft.SftSampleBuilder`.
Builder = Callable[[Any, Any], Any]


def dataset_rows(
    cfg: Any, split: str, *, eval_split: bool = False, stats: Any = None
) -> Sequence[Mapping[str, Any]]:
    """The rows of `split` as `cfg.data` names them (vlm-data: a hub dataset, a local parquet or
    JSONL file or folder, or a synthetic task)."""
    from vlm_data.sources import load_split

    return load_split(cfg.data, split, eval_split=eval_split, seed=cfg.run.seed, stats=stats)


def prompt_builder(cfg: Any, processor: Any) -> Any:
    """Row -> rollout prompt as `cfg.data` says (template, columns, length limit)."""
    from vlm_data.sources import prompt_builder

    return prompt_builder(cfg.data, processor)


def sft_builder(cfg: Any, processor: Any) -> Any:
    """Row -> SFT sample (`Answer: \\boxed{answer}` or the row's messages, loss on the reply)."""
    from vlm_data.sources import sft_builder

    return sft_builder(cfg.data, processor)


def check_data(cfg: Any) -> None:
    """A local dataset is there with its training split's files (`DatasetLoadError`)."""
    check_dataset(cfg.data)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a run chooses; the entry points (`GrpoRecipe`, `SftRecipe`) add theirs."""

    name: str  # the launcher's name: its error lines, its first log line
    config: type  # the config tree: a subclass of `GrpoConfig` / `SftConfig`
    trainers: Mapping[str, type[TrainerConfig]]  # `--backend`'s trainer configs, by name
    # each backend's actor class, by the same names (`trainers_fsdp.build.actor_class`): the
    # settings above name nothing they build, so the recipe hands both over
    actors: Mapping[str, ActorClass]
    description: str = ""  # `--help`'s text
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the recipe's values, by setting
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    env_aliases: Mapping[str, Sequence[str]] = field(default_factory=dict)  # setting -> names
    rows: Rows = dataset_rows
    sft_samples: Builder = sft_builder  # SFT runs and a GRPO run's warm-up
    check_data: Callable[[Any], None] = check_data  # refused before anything is written

    def setting(self, name: str) -> str:
        """How a message names a setting: `--dataset / GEO3K_DATASET_NAME`."""
        flag = "--" + name.replace("_", "-")
        names = self.env_aliases.get(name)
        return f"{flag} / {names[0]}" if names else flag

    def actor_class(self, backend: str) -> ActorClass:
        """The actor class of the trainer `--backend` picked (imported on call)."""
        return self.actors[backend]

    def other_trainers(self, backend: str | None) -> list[TrainerConfig]:
        """The backends not picked, in their defaults: where a layout refusal looks for a
        layout that fits."""
        return [config() for name, config in self.trainers.items() if name != backend]

    def print_extra(self, cfg: Any) -> Mapping[str, Any]:
        """What `--print-config` adds to the settings (the entry points: the layout)."""
        return {}

    def parse(self, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Any:
        """The config from flags, then the environment, the preset, the recipe's defaults."""
        return parse_config(
            self.config,
            argv,
            env=os.environ if env is None else env,
            env_aliases=self.env_aliases,
            presets=self.presets,
            defaults=self.defaults,
            description=self.description,
            prog=self.name,
            print_extra=self.print_extra,
        )

    def check(self, cfg: Any) -> None:
        """What parsing cannot see, checked before anything is printed or written (and before
        torch loads): the run folder can be one (and a `--resume` of it would not replace
        metrics with no checkpoint to continue them), a local dataset is there with its
        training split's files, this machine has the GPUs, and the model (and --tokenizer,
        --load) exists: a local folder, or a hub id on the hub or in the cache (asked, not
        downloaded)."""
        check_output_dir(cfg.run.output_dir, self.setting("output_dir"))
        if cfg.run.resume:
            check_resume(cfg.run.output_dir)
        with as_config_error(DatasetLoadError, self.setting("dataset")):
            self.check_data(cfg)
        check_gpus(cfg.cluster.num_gpus, preset=cfg.run.preset)
        check_model(cfg.model, load=cfg.run.load)

    def run(self, cfg: Any) -> Any:
        raise NotImplementedError

    def main(self, argv: Sequence[str] | None = None) -> None:
        """The launcher: parse, check, log the configuration, run. A mistake is one line and
        exit status 2, a fault that stops the run its line and 1, Ctrl-C 130 (`user_errors`)."""
        argv = sys.argv[1:] if argv is None else list(argv)
        with user_errors(self.name, argv, extra=(ModelSourceError,)):
            cfg = self.parse(argv)
            self.check(cfg)
            setup_logging(cfg.run.log_level)
            log.info("%s configuration:\n%s", self.name, to_json(cfg))
            self.run(cfg)

    # -- the steps the entry points share (torch and transformers load here) -------------------

    def settle(self, cfg: Any, **options: Any) -> Any:
        """`cfg` with the model resolved to local files and the layout chosen to fit, before
        Ray (`rl_runtime.settle`, with vlm-models' shapes)."""
        import vlm_models.sources

        model, parallel = settle(
            cfg.model,
            cfg.parallel,
            cfg.cluster,
            cfg.run,
            trainer=cfg.trainer,
            others=self.other_trainers(cfg.run.backend),
            shape_of=vlm_models.sources.shape_of,
            resolve=vlm_models.sources.resolve_model,
            **options,
        )
        return dataclasses.replace(cfg, model=model, parallel=parallel)

    def source(self, cfg: Any, builder: Any, split: str, *, eval_split: bool = False) -> Any:
        """`split`'s rows with `builder`: a `PromptSource` (a dataset that cannot be read
        is a one-line error naming --dataset)."""
        from vlm_data.sources import RowSource

        with as_config_error(DatasetLoadError, self.setting("dataset")):
            rows = self.rows(cfg, split, eval_split=eval_split, stats=builder.stats)
        return RowSource(rows, builder)

    def sft_source(self, cfg: Any, processor: Any) -> Any:
        """The SFT samples of the training split."""
        return self.source(cfg, self.sft_samples(cfg, processor), cfg.data.train_split)


def load_processor(cfg: Any, load: str | None) -> Any:
    """The processor: --tokenizer, else the loaded folder's, else the model's."""
    import vlm_data.sources
    import vlm_models.sources

    source = vlm_models.sources.processor_source(cfg.model, load=load)
    return vlm_data.sources.load_processor(source, cfg.data)


def model_source(cfg: Any, processor: Any, load: str | None) -> Any:
    """What the trainer ranks and engines build: a local folder or a preset, whose placeholder
    ids must be the processor's."""
    import vlm_data.tokens
    import vlm_models.sources

    token_ids = vlm_data.tokens.model_token_ids(processor)
    vlm_models.sources.check_token_ids(cfg.model, token_ids, load=load)
    return vlm_models.sources.model_source(cfg.model, load=load, token_ids=token_ids)


def trainer_for(cfg: Any, source: Any, **context: Any) -> TrainerConfig:
    """The trainer config completed for this run (`TrainerConfig.for_run`)."""
    run = RunContext(
        model=source,
        seed=cfg.run.seed,
        use_gpu=cfg.cluster.use_gpu,
        layout=cfg.parallel.trainer_layout(),
        **context,
    )
    return cfg.trainer.for_run(run)
