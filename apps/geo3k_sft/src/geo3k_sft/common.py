"""What both Geometry3K launchers share: config sections, environment aliases, and the small
builders that turn a config into data sources, a processor, trainer/engine factories and Ray.

The GRPO app imports this (it also runs the SFT app's code for the `--preset tiny` warm-up).
Environment variables are read only by the apps, through `ENV_ALIASES`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from rl_runtime import (
    ConfigError,
    Placement,
    TrainGroup,
    create_placement,
    init_ray,
    option,
    shutdown_ray,
    to_dict,
)

log = logging.getLogger(__name__)

SUPPORTED_MODELS = (
    "Qwen3-VL-2B-Instruct",
    "Qwen3-VL-4B-Instruct",
    "Qwen3-VL-8B-Instruct",
    "Qwen3-VL-30B-A3B-Instruct",
    "Qwen3-VL-235B-A22B-Instruct",
    "Qwen3-VL-2B-Thinking",
    "Qwen3-VL-4B-Thinking",
    "Qwen3-VL-8B-Thinking",
    "Qwen3-VL-30B-A3B-Thinking",
    "Qwen3-VL-235B-A22B-Thinking",
)

TINY_MODEL = "qwen3-vl-tiny"
#: What both launchers' `--preset tiny` share: a CPU run of a random-init tiny Qwen3-VL with the
#: offline tiny processor on the synthetic colour task.
TINY_RUN: dict[str, Any] = {
    "backend": "fsdp",
    "num_gpus": 0,
    "model_name": TINY_MODEL,
    "tokenizer": "tiny",
    "dataset": "synthetic:color",
    "attn_implementation": "sdpa",
}
SYNTHETIC = "synthetic"


def _aliases(suffix: str) -> list[str]:
    return [f"GEO3K_{suffix}", f"MILES_SCRIPT_{suffix}", f"SLIME_SCRIPT_{suffix}"]


#: Config field -> environment variables (first set wins): ours, then the reference recipes'.
ENV_ALIASES: dict[str, list[str]] = {
    "backend": _aliases("TRAIN_BACKEND"),
    "model_name": _aliases("MODEL_NAME"),
    "dataset": _aliases("DATASET_NAME"),
    "num_gpus": _aliases("NUM_GPUS"),
    "external_ray": _aliases("EXTERNAL_RAY"),
    "preset": ["GEO3K_PRESET"],
    "output_dir": ["GEO3K_OUTPUT_DIR"],
    "wandb": ["GEO3K_WANDB"],
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


#: `vlm_data.TEMPLATES`' names, written out: importing vlm_data (transformers) at parse time
#: costs seconds (a launcher test checks the two agree).
TEMPLATE_NAMES = ("none", "boxed", "think-boxed")


@dataclass
class RunSection:
    preset: str | None = option(None, "named preset; 'tiny' runs on any CPU in minutes")
    output_dir: str = option("runs/geo3k", "the run folder (metrics, plot, checkpoints)")
    resume: bool = option(False, "continue from the last complete checkpoint in --output-dir")
    load: str | None = option(None, "start from these weights (an HF folder or an SFT run folder)")
    backend: Literal["megatron", "fsdp"] = option("megatron", "training backend")
    num_gpus: int = option(8, "GPUs to use (0: CPU run)", ge=0)
    colocate: bool = option(True, "trainer and rollout share the GPUs (offload between phases)")
    rollout_num_gpus: int | None = option(
        None, "separate mode: GPUs for rollout engines (default: half of --num-gpus)", ge=1
    )
    cpu_trainers: int = option(1, "CPU run: trainer ranks (gloo)", ge=1)
    cpu_engines: int = option(1, "CPU run: rollout engines", ge=1)
    external_ray: bool = option(False, "connect to a running Ray cluster (address 'auto')")
    ray_address: str | None = option(None, "Ray cluster address (implies an external cluster)")
    ray_num_cpus: int | None = option(None, "CPUs of the local Ray (default: all)", ge=1)
    wandb: bool = option(False, "log to W&B (also on when WANDB_API_KEY is set)")
    wandb_project: str = option("glimpse-geo3k", "W&B project")
    seed: int = option(1234, "global seed (model init, data order, sampling)", ge=0)
    gpu_memory_gib: float | None = option(
        None,
        "memory per GPU for the layout check (default: what the GPU reports, read without "
        "allocating; 0: no check)",
        ge=0,
    )
    log_level: str = option(
        "INFO", "logging level (DEBUG: tracebacks for errors)", choices=LOG_LEVELS
    )

    def check(self) -> None:
        rollout = self.rollout_num_gpus or max(1, self.num_gpus // 2)
        if self.num_gpus and not self.colocate and rollout >= self.num_gpus:
            raise ConfigError(
                f"--no-colocate --rollout-num-gpus {rollout} leaves no GPU for training "
                f"(--num-gpus {self.num_gpus})"
            )


@dataclass
class ModelSection:
    model_name: str = option(
        "Qwen3-VL-8B-Instruct",
        f"model: a name of {', '.join(SUPPORTED_MODELS[:3])}..., a hub id, a local folder, "
        f"or '{TINY_MODEL}' (random init)",
    )
    tokenizer: str | None = option(
        None, "processor source: a folder or hub id, 'tiny' (built offline); default: the model's"
    )
    attn_implementation: str = option("packed", "trainer attention (packed | sdpa | ...)")
    param_dtype: str | None = option(None, "compute dtype (default: bfloat16 on GPU, fp32 on CPU)")
    gradient_checkpointing: bool | None = option(
        None,
        "activation checkpointing (recompute) in the trainer (default: off, or on where the "
        "memory estimate needs it)",
    )
    freeze_vision: bool = option(False, "keep the vision tower frozen")
    compile: bool | None = option(
        None,
        "fsdp backend: torch.compile each decoder layer, vision block and the log-prob kernels "
        "(default: on GPU for dense Qwen3-VL, otherwise off)",
    )
    max_tokens_per_gpu: int = option(16384, "micro-batch token budget per GPU", ge=1)
    fsdp_replicate: bool = option(
        False,
        "fsdp backend on several GPUs: each holds the whole model (bf16 over float32 masters) "
        "and one all-reduce averages the gradients, instead of FSDP sharding; for models that "
        "fit on one GPU",
    )
    tensor_parallel: int | None = option(
        None,
        "megatron backend: tensor-parallel size (default: 1, or the smallest that fits by the "
        "memory estimate when this, --sequence-parallel and --gradient-checkpointing are unset)",
        ge=1,
    )
    sequence_parallel: bool | None = option(
        None, "megatron backend: sequence parallel (needs TP > 1; default: on with TP > 1 chosen)"
    )
    pipeline_parallel: int = option(
        1, "megatron backend: pipeline stages (megatron-core's 1F1B schedule)", ge=1
    )
    expert_parallel: int = option(
        1,
        "megatron backend, MoE models: split the experts over this many data-parallel ranks",
        ge=1,
    )
    recompute: Literal["auto", "none", "selective", "full"] = option(
        "auto",
        "activation recomputation: full (whole decoder layers), selective (megatron backend: "
        "core attention) or none; auto: full with --gradient-checkpointing, none with "
        "--no-gradient-checkpointing, else as the memory estimate needs",
    )
    distributed_optimizer: bool = option(
        True,
        "megatron backend: megatron-core's distributed optimizer (float32 masters and AdamW "
        "moments sharded over data-parallel ranks); --no-distributed-optimizer keeps them whole",
    )

    def check(self) -> None:
        if self.sequence_parallel and (self.tensor_parallel or 1) < 2:
            raise ConfigError("--sequence-parallel needs --tensor-parallel of 2 or more")
        gc, mode = self.gradient_checkpointing, self.recompute
        if mode != "auto" and gc is not None and gc != (mode == "full"):
            raise ConfigError(
                f"--recompute {mode} contradicts --{'' if gc else 'no-'}gradient-checkpointing "
                "(which means --recompute full / none); give one of them"
            )


def recompute_mode(model: ModelSection) -> str:
    """The recomputation ``model`` asks for: ``--recompute``, else ``--gradient-checkpointing``."""
    if model.recompute != "auto":
        return model.recompute
    return "full" if model.gradient_checkpointing else "none"


@dataclass
class DataSection:
    dataset: str = option(
        "chenhegu/geo3k_imgurl",
        "dataset: hub name, local parquet/jsonl file or folder, or 'synthetic[:task]'",
    )
    train_split: str = option("train", "training split")
    eval_split: str = option("test", "evaluation split (falls back to 'validation')")
    prompt_key: str = option("problem", "column with the question (and <image> placeholders)")
    answer_key: str = option("answer", "column with the ground-truth answer")
    image_key: str = option("images", "column with the images")
    template: str = option("boxed", "prompt template", choices=TEMPLATE_NAMES)
    max_prompt_length: int | None = option(None, "drop (and count) longer prompts", ge=1)
    min_pixels: int | None = option(None, "image processor min pixels", ge=1)
    max_pixels: int | None = option(None, "image processor max pixels", ge=1)
    synthetic_train_size: int = option(1024, "synthetic task: training rows", ge=1)
    synthetic_eval_size: int = option(64, "synthetic task: evaluation rows", ge=1)

    def check(self) -> None:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ConfigError(
                f"--min-pixels {self.min_pixels} is above --max-pixels {self.max_pixels}"
            )


@dataclass
class OptimSection:
    lr: float = option(1e-6, "learning rate (the peak, after any warm-up)", gt=0)
    lr_schedule: Literal["constant", "cosine"] = option("constant", "learning-rate schedule")
    lr_warmup_steps: int = option(0, "linear warm-up steps", ge=0)
    adam_beta1: float = option(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = option(0.98, "Adam beta2", ge=0, lt=1)
    weight_decay: float = option(0.1, "weight decay", ge=0)
    clip_grad: float = option(1.0, "gradient-norm clip (0: report the norm, do not clip)", ge=0)


def check_backend_options(run: RunSection, model: ModelSection) -> None:
    """Options one backend has and the other lacks, checked before anything starts."""
    if run.backend == "fsdp" and ((model.tensor_parallel or 1) > 1 or model.sequence_parallel):
        raise ConfigError(
            "--tensor-parallel / --sequence-parallel are for --backend megatron; "
            "the fsdp backend shards instead"
        )
    if run.backend == "fsdp" and max(model.pipeline_parallel, model.expert_parallel) > 1:
        raise ConfigError("--pipeline-parallel / --expert-parallel are for --backend megatron")
    if run.backend == "fsdp" and model.recompute == "selective":
        raise ConfigError("--recompute selective is for --backend megatron (fsdp: full or none)")


def optim_config(opt: OptimSection, total_steps: int | None = None) -> Any:
    from trainers_fsdp import OptimConfig

    return OptimConfig(
        lr=opt.lr,
        betas=(opt.adam_beta1, opt.adam_beta2),
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.clip_grad,
        lr_schedule=opt.lr_schedule,
        warmup_steps=opt.lr_warmup_steps,
        total_steps=total_steps,
    )


# ---------------------------------------------------------------------------------- model


def resolve_load(path: str) -> str:
    """An SFT (or GRPO) run folder stands for its exported `hf/` folder."""
    p = Path(path).expanduser()
    if (p / "hf" / "config.json").is_file():
        return str(p / "hf")
    if not (p / "config.json").is_file():
        raise ConfigError(f"--load {path}: no config.json there (nor in {p / 'hf'})")
    return str(p)


def model_source(model: ModelSection, run: RunSection, processor: Any) -> Any:
    """What `vlm_models.build_model` / `FsdpConfig.model` should get."""
    if run.load:
        return resolve_load(run.load)
    name = model.model_name
    from vlm_models import PRESETS, TINY_PRESETS, tiny_config

    if name in TINY_PRESETS:
        tok = processor.tokenizer
        ids = {t: tok.convert_tokens_to_ids(t) for t in _VISION_TOKENS}
        return tiny_config(
            name,
            vocab_size=len(tok),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        )
    if name in PRESETS:  # a shape preset: random weights, asked for by name
        return name
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    return name if "/" in name else f"Qwen/{name}"


_VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def build_processor(model: ModelSection, run: RunSection, data: DataSection) -> Any:
    from vlm_data import build_processor as build
    from vlm_data import tiny_processor

    source = model.tokenizer
    if source is None and run.load:
        loaded = Path(resolve_load(run.load))
        if any(
            (loaded / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")
        ):
            source = str(loaded)
    if source is None:
        source = "tiny" if model.model_name == TINY_MODEL else model_source(model, run, None)
    if source == "tiny":
        return tiny_processor()
    return build(source, min_pixels=data.min_pixels, max_pixels=data.max_pixels)


def vision_token_ids(processor: Any) -> list[int]:
    """Image / video placeholder ids: a response must never contain them."""
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in _VISION_TOKENS]
    return [i for i in ids if i is not None and i >= 0 and i != tok.unk_token_id]


def eos_token_ids(processor: Any) -> list[int]:
    tok = processor.tokenizer
    ids = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(i for i in ids if i is not None and i >= 0)


# ---------------------------------------------------------------------------------- data


def load_split(
    data: DataSection,
    split: str,
    *,
    eval_split: bool = False,
    seed: int = 0,
    stats: Any = None,
) -> Any:
    """Rows of one split: the synthetic task, or `vlm_data.load_rows` (malformed lines are
    counted in `stats`, a builder's counter)."""
    from vlm_data import DatasetLoadError, load_rows, make_synthetic_rows

    if data.dataset == SYNTHETIC or data.dataset.startswith(SYNTHETIC + ":"):
        task = data.dataset.partition(":")[2] or "count-dots"
        n = data.synthetic_eval_size if eval_split else data.synthetic_train_size
        return make_synthetic_rows(n, seed=seed + (1 if eval_split else 0), task=task)
    keys = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key)
    keys |= {"stats": stats}
    try:
        try:
            return load_rows(data.dataset, split=split, **keys)
        except DatasetLoadError:
            if not eval_split or split == "validation":
                raise
            log.warning("no %r split in %s; evaluating on 'validation'", split, data.dataset)
            return load_rows(data.dataset, split="validation", **keys)
    except DatasetLoadError as err:  # a path or name the user gave: one line, exit 2
        raise ConfigError(f"--dataset / GEO3K_DATASET_NAME: {err}") from err


class RowSource:
    """A `rl_runtime.PromptSource` over dataset rows and a vlm_data builder (PromptBuilder or
    SftSampleBuilder): bad rows come back as None, logged and counted by the builder."""

    def __init__(self, rows: Any, builder: Any) -> None:
        self.rows = rows
        self.builder = builder

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, index: int) -> Any | None:
        try:
            row = self.rows[index]
        except Exception as e:  # a row the dataset itself cannot decode
            log.warning("skipping row %d: cannot read it (%s)", index, e)
            self.builder.stats["unreadable"] += 1
            return None
        return self.builder.maybe_build(row, index)

    @property
    def skipped(self) -> int:
        return sum(n for reason, n in self.builder.stats.items() if reason != "built")


# ---------------------------------------------------------------------------------- actors


def make_fsdp_actor(config: Any) -> Any:
    """Runs inside a trainer Ray actor."""
    from trainers_fsdp import FsdpActor

    return FsdpActor(config)


def make_megatron_actor(config: Any) -> Any:
    import trainers_megatron

    return trainers_megatron.MegatronActor(config)


def make_hf_engine(source: Any, eos_ids: list[int], pad_id: int, max_batch_size: int) -> Any:
    """Runs inside a rollout Ray actor: a transformers engine (CPU, or GPU without SGLang)."""
    from rollout_sglang import HFEngine
    from vlm_models import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(source, attn_implementation="sdpa").to(device)
    return HFEngine(
        model,
        device=device,
        eos_token_ids=eos_ids,
        max_batch_size=max_batch_size,
        pad_token_id=pad_id,
    )


def make_sglang_engine(engine_config: Any) -> Any:
    """Runs inside a rollout Ray actor: SGLang on the actor's GPU(s)."""
    from rollout_sglang import build_engine

    return build_engine(engine_config)


def fsdp_config(
    model: ModelSection,
    run: RunSection,
    source: Any,
    optim: Any,
    *,
    temperature: float = 1.0,
    grpo: Any = None,
    reference_model: bool = False,
) -> Any:
    from trainers_fsdp import FsdpConfig

    kwargs: dict[str, Any] = {}
    if grpo is not None:
        kwargs["grpo"] = grpo
    return FsdpConfig(
        model=source,
        attn_implementation=model.attn_implementation,
        freeze_vision=model.freeze_vision,
        device="cuda" if run.num_gpus > 0 else "cpu",
        param_dtype=model.param_dtype,
        activation_checkpointing=recompute_mode(model) == "full",
        compile=model.compile,
        max_tokens_per_gpu=model.max_tokens_per_gpu,
        replicate=model.fsdp_replicate,
        temperature=temperature,
        optim=optim,
        reference_model=reference_model,
        seed=run.seed,
        **kwargs,
    )


def megatron_config(
    model: ModelSection,
    run: RunSection,
    source: Any,
    opt: OptimSection,
    *,
    total_steps: int | None = None,
    temperature: float = 1.0,
    grpo: Any = None,
    reference_model: bool = False,
) -> Any:
    from trainers_megatron import MegatronConfig

    kwargs: dict[str, Any] = {}
    if grpo is not None:
        kwargs["grpo"] = grpo
    return MegatronConfig(
        model=source,
        tp=model.tensor_parallel or 1,
        sp=bool(model.sequence_parallel),
        pp=model.pipeline_parallel,
        ep=model.expert_parallel,
        distributed_optimizer=model.distributed_optimizer,
        param_dtype=model.param_dtype,
        recompute=recompute_mode(model),
        reference_model=reference_model,
        max_tokens_per_gpu=model.max_tokens_per_gpu,
        temperature=temperature,
        lr=opt.lr,
        betas=(opt.adam_beta1, opt.adam_beta2),
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.clip_grad,
        lr_schedule=opt.lr_schedule,
        warmup_steps=opt.lr_warmup_steps,
        total_steps=total_steps,
        seed=run.seed,
        **kwargs,
    )


def actor_config(
    model: ModelSection,
    run: RunSection,
    source: Any,
    opt: OptimSection,
    total_steps: int | None = None,
    **kwargs: Any,
) -> Any:
    """The trainer config of the chosen backend."""
    if run.backend == "megatron":
        return megatron_config(model, run, source, opt, total_steps=total_steps, **kwargs)
    return fsdp_config(model, run, source, optim_config(opt, total_steps), **kwargs)


def trainer_factory(run: RunSection, actor_config: Any) -> Any:
    if run.backend == "megatron":
        return functools.partial(make_megatron_actor, actor_config)
    return functools.partial(make_fsdp_actor, actor_config)


def tp_size(run: RunSection, model: ModelSection) -> int:
    return (model.tensor_parallel or 1) if run.backend == "megatron" else 1


def pp_size(run: RunSection, model: ModelSection) -> int:
    return model.pipeline_parallel if run.backend == "megatron" else 1


# ---------------------------------------------------------------------------------- Ray


@dataclass
class Layout:
    """How many trainer ranks and engines, and whether they share devices."""

    num_trainers: int
    num_engines: int
    colocate: bool
    use_gpu: bool
    gpus_per_engine: int = 1  # SGLang tensor parallel: each engine's GPUs


def layout(run: RunSection, *, with_engines: bool = True) -> Layout:
    if run.num_gpus <= 0:
        engines = run.cpu_engines if with_engines else 0
        return Layout(run.cpu_trainers, engines, run.colocate, False)
    if run.colocate or not with_engines:
        return Layout(run.num_gpus, run.num_gpus if with_engines else 0, True, True)
    rollout = run.rollout_num_gpus or max(1, run.num_gpus // 2)
    if rollout >= run.num_gpus:
        raise ConfigError(
            f"--rollout-num-gpus {rollout} leaves no GPU for training (--num-gpus {run.num_gpus})"
        )
    return Layout(run.num_gpus - rollout, rollout, False, True)


@dataclass
class RayHandle:
    placement: Placement
    owns_ray: bool
    actors: list[Any] = field(default_factory=list)

    def close(self) -> None:

        for group in self.actors:
            try:
                group.shutdown()
            except Exception:  # shutting down is best effort
                log.debug("group shutdown failed", exc_info=True)
        self.placement.remove()
        if self.owns_ray:
            shutdown_ray()


def start_ray(run: RunSection, lay: Layout) -> RayHandle:
    import ray

    owns = not ray.is_initialized()
    address = run.ray_address or ("auto" if run.external_ray else None)
    init_ray(address, num_cpus=run.ray_num_cpus)
    placement = create_placement(
        num_trainers=lay.num_trainers,
        num_engines=lay.num_engines,
        colocate=lay.colocate,
        use_gpu=lay.use_gpu,
        cpus_per_bundle=2.0 if lay.use_gpu else 0.5,
        gpus_per_engine=lay.gpus_per_engine,
    )
    return RayHandle(placement, owns)


def train_group(
    run: RunSection, model: ModelSection, actor_cfg: Any, lay: Layout, ray_handle: RayHandle
) -> TrainGroup:
    """The trainer ranks as Ray actors, registered with `ray_handle` for shutdown."""
    group = TrainGroup(
        trainer_factory(run, actor_cfg),
        world_size=lay.num_trainers,
        placement=ray_handle.placement,
        num_cpus=actor_cpus(lay),
        tp_size=tp_size(run, model),
        pp_size=pp_size(run, model),
    )
    ray_handle.actors.append(group)
    return group


def actor_cpus(lay: Layout) -> float:
    """CPUs each actor asks for inside its bundle (two actors share a colocated bundle)."""
    per_bundle = 2.0 if lay.use_gpu else 0.5
    return per_bundle / 2 if lay.colocate else per_bundle


def use_wandb(run: RunSection, env: dict[str, str] | os._Environ) -> bool:
    return bool(run.wandb or env.get("WANDB_API_KEY"))


def write_config(cfg: Any, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
