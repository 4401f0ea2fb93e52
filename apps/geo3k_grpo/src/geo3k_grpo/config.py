"""geo3k_grpo's configuration: the packages' own configs as one tree, the recipe's values and
the presets. Nothing is declared here a second time: each setting is its package's field.

Every setting has a dotted flag (`--trainer.optim.lr`, `--loop.num-rollout`) and a short one
(`--lr`, `--num-rollout`: the names of the README's migration table); `--backend` picks the
trainer section. The environment names (`GEO3K_*`, then the recipes' `MILES_SCRIPT_*` and
`SLIME_SCRIPT_*`) are `rl_runtime.recipe_env_aliases`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trainers_fsdp.build
import trainers_megatron.build
from rewards_math import RewardConfig
from rl_algos import GrpoLossConfig
from rl_runtime import (
    ActorClass,
    ClusterConfig,
    ColocationPlan,
    ConfigError,
    GrpoLoopConfig,
    MemoryEstimate,
    ModelShape,
    ParallelConfig,
    PreflightError,
    RunConfig,
    TrainerConfig,
    WarmupConfig,
    check_parallel,
    choice,
    coarsest_dtype,
    engine_cache,
    gpu_memory_bytes,
    host_budget,
    layout,
    layout_report,
    parse_config,
    plan_colocation,
    plan_layout,
    recipe_env_aliases,
    section,
    state_estimate,
)
from rollout_sglang import RolloutConfig
from trainers_fsdp import FsdpConfig
from trainers_megatron import MegatronConfig
from vlm_data import DataConfig
from vlm_models import ModelConfig

DESCRIPTION = """GRPO on Geometry3K (the miles / slime geo3k VLM recipe), `uv run apps/geo3k_grpo`.
Defaults are the recipe's: 3000 rollouts of 64 prompts x 8 samples, global batch 512, the
problem as is in the chat template, temperature 0.8, responses up to 4096 tokens, eps_clip
0.2 / 0.28, no KL, seq-mean-token-mean, lr 1e-6 constant, Adam betas 0.9 / 0.98, weight decay
0.1, the math reward, evaluation at step 0 and every 20 steps on the test split.
--preset tiny runs the whole thing on a CPU in minutes (with a short SFT warm-up first)."""

TRAINERS = {"megatron": MegatronConfig, "fsdp": FsdpConfig}
#: each backend's actor class, imported on call (in a trainer rank; its settings above name
#: nothing they build)
ACTORS: dict[str, ActorClass] = {
    "megatron": trainers_megatron.build.actor_class,
    "fsdp": trainers_fsdp.build.actor_class,
}
ENV_ALIASES = recipe_env_aliases("GEO3K")


def other_trainers(backend: str) -> list[TrainerConfig]:
    """The backends not picked, in their defaults: where a layout refusal looks for a layout
    that fits."""
    return [config() for name, config in TRAINERS.items() if name != backend]


@dataclass
class Geo3kGrpoConfig:
    run: RunConfig = section(RunConfig)
    cluster: ClusterConfig = section(ClusterConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    loss: GrpoLossConfig = section(GrpoLossConfig)
    reward: RewardConfig = section(RewardConfig)
    trainer: MegatronConfig | FsdpConfig = choice(TRAINERS, by="backend")
    loop: GrpoLoopConfig = section(GrpoLoopConfig)
    warmup: WarmupConfig = section(
        WarmupConfig,
        "the SFT warm-up before GRPO (without --load): its own steps, batch and constant "
        "learning rate; the trainer section's --lr, --lr-schedule, --lr-warmup-steps and "
        "--min-lr are the GRPO steps'",
    )

    def check(self) -> None:
        self.run = self.run.with_wandb_names(self.model.model_name)  # shown by --print-config
        try:
            check_parallel(self.trainer, self.parallel, self.cluster)
            if self.rollout.backend != "hf":  # SGLang engines of N GPUs take N rollout GPUs
                layout(self.cluster, gpus_per_engine=self.rollout.tp_size)
        except (ConfigError, PreflightError) as err:
            if self.run.preset is None:
                raise
            raise ConfigError(
                f"{err} (--preset {self.run.preset} sets this layout: {_preset_layout(self)})"
            ) from None


#: The recipe's values where a package's default is not the recipe's (the rest are).
RECIPE: dict[str, Any] = {
    "backend": "megatron",
    "output_dir": "runs/geo3k_grpo",
    "wandb_project": "glimpse-geo3k",
    # the problem as the row has it, in the chat template (--input-key problem
    # --apply-chat-template); --template boxed adds an instruction to answer in \boxed{}
    "template": "none",
    # no --calculate-per-token-loss: each sample's tokens averaged, then the samples
    "loss_agg_mode": "seq-mean-token-mean",
    "num_rollout": 3000,
}

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
        "attn_implementation": "sdpa",
        "output_dir": "runs/geo3k_grpo_tiny",
        # 16-token replies: the tests' learning figures (2026-12-01/02) were measured with it
        "loss_agg_mode": "token-mean",
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


#: The slime recipe's Qwen3.5-35B-A3B run (examples/geo3k_vlm/run_geo3k_qwen35.sh, MoE branch)
#: on one node of 8 GPUs, colocated; its GRPO, optimizer and rollout values are the recipe's
#: defaults above. Glimpse packs samples into micro-batches where slime runs one at a time
#: (micro-batch 1, no dynamic batch size: megatron-core's gated delta net refuses packed rows;
#: ours resets its state at each sample's boundary, so packing gives the same log-probs).
PRESETS["qwen3.5-35b-a3b"] = {
    "backend": "megatron",
    "num_gpus": 8,
    "model_name": "Qwen3.5-35B-A3B",
    "output_dir": "runs/geo3k_grpo_qwen35_35b_a3b",
    # attention over TP2 + SP (two KV groups: TP 2 at most), whole experts over EP8
    "tensor_parallel": 2,
    "sequence_parallel": True,
    "expert_parallel": 8,
    "expert_tensor_parallel": 1,
    "recompute": "full",
    # SGLang as the script's SGLANG_ARGS (slime 624b824, run_geo3k_qwen35.sh lines 110-123):
    # one engine of 8 GPUs, experts over EP8, decode graphs up to 256, 512 requests at once,
    # speculative decoding from the checkpoint's MTP head (EAGLE, 2 steps, top-1, 3 tokens)
    "rollout_engine": "sglang",
    "rollout_num_gpus_per_engine": 8,
    "sglang_ep_size": 8,
    "sglang_mem_fraction_static": 0.7,
    "sglang_cuda_graph_bs": (1, 2, 4, *range(8, 257, 8)),
    "sglang_speculative_algorithm": "EAGLE",
    "sglang_speculative_num_steps": 2,
    "sglang_speculative_eagle_topk": 1,
    "sglang_speculative_num_draft_tokens": 3,
    "sglang_max_running_requests": 512,
    # the script's `--rm-type deepscaler`: only the answer after `</think>` counts
    "reward_type": "deepscaler",
}


def _preset_layout(cfg: Geo3kGrpoConfig) -> str:
    """A preset's layout settings as flags, for a refusal's message."""
    p, r = cfg.parallel, cfg.rollout
    parts = [f"--backend {cfg.run.backend}", f"--num-gpus {cfg.cluster.num_gpus}"]
    parts += [f"--tensor-parallel {p.tensor_parallel}"] * bool(p.tensor_parallel)
    parts += [f"--expert-parallel {p.expert_parallel}"] * (p.expert_parallel > 1)
    if p.expert_tensor_parallel is not None:
        parts.append(f"--expert-tensor-parallel {p.expert_tensor_parallel}")
    parts += [f"--rollout-num-gpus-per-engine {r.tp_size}"] * (r.tp_size > 1)
    return " ".join(parts)


def print_layout(cfg: Geo3kGrpoConfig) -> dict[str, Any]:
    """`--print-config`'s training layout and its memory estimate."""
    from vlm_models.sources import shape_of  # transformers: only when asked

    shape = shape_of(cfg.model, load=cfg.run.load) if cfg.cluster.use_gpu else None
    common = dict(
        trainer=cfg.trainer,
        shape=shape,
        others=other_trainers(cfg.run.backend),
        model_name=cfg.model.model_name,
        longest_sample=longest_sample(cfg),
        engines_park_weights=cfg.rollout.weights_cpu_backup,
    )
    try:  # the offload decision of the layout the run would settle on (its optimizer offload)
        settled, _ = plan_layout(cfg.parallel, cfg.cluster, **common)
    except PreflightError:
        settled = cfg.parallel
    plan = colocation_plan(dataclasses.replace(cfg, parallel=settled), cfg.parallel.offload_options)
    colocation = {"on": plan.offload_train, "why": plan.why}
    if plan.kv_cache_tokens is not None or cfg.rollout.cache_tokens is not None:
        # the transformers engine's KV cache: the plan's tokens unless --rollout-cache-tokens
        colocation["kv_cache_tokens"] = plan.kv_cache_tokens
        colocation["cache_tokens"] = rollout_config(cfg, plan).cache_tokens
    raised = plan.optimizer_offload != settled.offload_fraction  # to give the cache room
    # the layout as the run will hold it: with a raised fraction, that fraction's estimate
    shown = settled.with_optimizer_offload(plan.optimizer_offload) if raised else cfg.parallel
    report = layout_report(shown, cfg.cluster, backend=cfg.run.backend, **common)
    if raised:
        colocation["optimizer_offload_fraction"] = plan.optimizer_offload
        report["optimizer_cpu_offload"] = (
            f"chosen: {settled.offload_fraction:.0%} of it on the host for the layout, raised to "
            f"{plan.optimizer_offload:.0%} colocated (offload_train says why)"
        )
    out = {"layout": report, "offload_train": colocation}
    if cfg.cluster.ray_to_join is None:  # where each actor goes: only on a cluster
        return out
    from rl_runtime import placement_preview  # Ray

    lay = layout(cfg.cluster, gpus_per_engine=cfg.rollout.tp_size)
    return out | {"placement": placement_preview(cfg.cluster, lay)}


#: Prompt tokens assumed per sequence when ``--max-prompt-length`` is unset (Geometry3K's
#: prompts with their image: 109-436 tokens in the validation split).
ASSUMED_PROMPT_TOKENS = 1024


def longest_sample(cfg: Geo3kGrpoConfig) -> int:
    """Tokens of the longest sequence a step trains on (prompt and response), which one
    micro-batch holds whole: what the layout's memory estimate sizes context parallelism by."""
    return (cfg.data.max_prompt_length or ASSUMED_PROMPT_TOKENS) + cfg.loop.rollout_max_response_len


def compute_dtype(cfg: Geo3kGrpoConfig, use_gpu: bool) -> str:
    """The coarsest of the engine's and the trainer's compute dtypes and the dtype the weights
    are pushed in, whose band the log-prob gap between engine and trainer is judged by
    (``rl_runtime.logprob_guard``). On the CPU the transformers engine computes in float32,
    and the trainer by default, but the engine holds the weights as pushed (bfloat16 unless
    the trainer's ``export_dtype`` says otherwise)."""
    engine = cfg.rollout.dtype if use_gpu else "float32"
    trainer = cfg.trainer.param_dtype or ("bfloat16" if use_gpu else "float32")
    return coarsest_dtype(engine, trainer, cfg.trainer.export_dtype)


def colocation_plan(cfg: Geo3kGrpoConfig, fractions: Sequence[float] = ()) -> ColocationPlan:
    """Where the trainer's state sits while the engine generates, for the settled layout in
    ``cfg.parallel``: ``--offload-train`` as set; unset, colocated on GPUs with the
    transformers engine, as ``rl_runtime.plan_colocation`` finds (on the GPU where the engine's
    KV cache holds a rollout beside it, else offloaded where the host holds it, else on the GPU
    with more of the optimizer on the host, one of ``fractions``: those the user left free).
    SGLang sizes its pool once at start, so it keeps the recipes' offload. Colocated on GPUs
    with the transformers engine and a known shape, the plan also sizes the engine's KV cache
    in tokens beside what the trainer keeps, the sequences' recurrent states (Qwen3.5's
    ``ModelShape.state_bytes_per_sequence``) counted, ``--offload-train`` set or not
    (``kv_cache_tokens``, the engine's ``cache_tokens`` unless set: :func:`rollout_config`)."""
    from rollout_sglang.launch import uses_sglang  # torch: only when asked
    from vlm_models.sources import shape_of  # transformers: only when asked

    current, chosen = cfg.parallel.offload_fraction, cfg.loop.offload_train

    def unplanned(why: str) -> ColocationPlan:
        if chosen is not None:
            return ColocationPlan(current, chosen, "set")
        return ColocationPlan(current, True, why)

    lay = layout(cfg.cluster, gpus_per_engine=cfg.rollout.tp_size)
    if not (lay.colocate and lay.use_gpu):
        return unplanned("not colocated on GPUs")
    if uses_sglang(cfg.rollout, lay.use_gpu):
        return unplanned("SGLang engine")
    shape = shape_of(cfg.model, load=cfg.run.load)
    gpu = gpu_memory_bytes(cfg.parallel)
    if shape is None or gpu is None:
        return unplanned("no memory estimate")
    model = ModelShape(**shape)

    def estimate_at(fraction: float) -> MemoryEstimate:
        parallel = cfg.parallel.with_optimizer_offload(fraction)
        out = state_estimate(parallel, cfg.cluster, trainer=cfg.trainer, shape=shape)
        assert out is not None  # GPUs and a known shape
        return out

    samples = cfg.loop.rollout_batch_size * cfg.loop.n_samples_per_prompt
    engine = dict(
        gpu_bytes=gpu,
        engine_sequences=min(cfg.rollout.max_batch_size, -(-samples // lay.num_engines)),
        engine_share=cfg.rollout.kv_cache_fraction,
        state_bytes_per_sequence=model.state_bytes_per_sequence,
    )
    if chosen is not None:  # the cache beside what the trainer keeps: nothing when offloaded
        estimate = estimate_at(current)
        if chosen:
            estimate = dataclasses.replace(estimate, kept=0.0)
        _, tokens = engine_cache(model, estimate, **engine)
        return ColocationPlan(current, chosen, "set", tokens or None)
    return plan_colocation(
        model,
        estimate_at,
        current=current,
        fractions=fractions,
        host_bytes=host_budget(
            cfg.parallel,
            cfg.cluster,
            model,
            with_engines=True,
            engines_park_weights=cfg.rollout.weights_cpu_backup,
        ),
        tokens_per_sequence=longest_sample(cfg),
        **engine,
    )


def rollout_config(cfg: Geo3kGrpoConfig, plan: ColocationPlan) -> RolloutConfig:
    """The engines' settings for the run: the colocation plan's KV-cache tokens as the
    transformers engine's ``cache_tokens``, unless ``--rollout-cache-tokens`` sets them (a
    user's value wins) or the plan has none (the engine then takes ``--kv-cache-fraction`` of
    the memory free)."""
    if cfg.rollout.cache_tokens is not None or plan.kv_cache_tokens is None:
        return cfg.rollout
    return dataclasses.replace(cfg.rollout, cache_tokens=plan.kv_cache_tokens)


def parse(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> Geo3kGrpoConfig:
    return parse_config(
        Geo3kGrpoConfig,
        argv,
        env=os.environ if env is None else env,
        env_aliases=ENV_ALIASES,
        presets=PRESETS,
        defaults=RECIPE,
        description=DESCRIPTION,
        prog="geo3k_grpo",
        print_extra=print_layout,
    )
