"""The launchers' configuration and preflight, without starting a run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from geo3k_grpo.main import RECIPE as GRPO
from geo3k_grpo.main import parse as parse_grpo
from geo3k_grpo.main import run as run_grpo
from geo3k_sft.main import parse as parse_sft
from rl_runtime import ConfigError, ParallelLayout, PreflightError, ResumeError, RunContext
from rl_runtime.grpo_plan import compute_dtype, rollout_config

ROOT = Path(__file__).resolve().parent.parent


def colocation_plan(cfg, fractions=()):
    """The geo3k launcher's colocation plan (`rl_runtime.grpo_plan`, with its engines)."""
    from rl_runtime.grpo_plan import colocation_plan

    return colocation_plan(cfg, fractions, engines=GRPO.engines().launch)


def test_recipe_defaults():
    cfg = parse_grpo([], env={})
    loop, loss, optim = cfg.loop, cfg.loss, cfg.trainer.optim
    assert (loop.rollout_batch_size, loop.n_samples_per_prompt, loop.global_batch_size) == (
        64,
        8,
        512,
    )
    assert (loop.rollout_temperature, loop.rollout_max_response_len) == (0.8, 4096)
    assert (loss.eps_clip, loss.eps_clip_high, loss.kl_coef, cfg.reward.reward_type) == (
        0.2,
        0.28,
        0.0,
        "math",
    )
    assert (optim.lr, optim.lr_schedule, optim.betas[0], optim.betas[1]) == (
        1e-6,
        "constant",
        0.9,
        0.98,
    )
    assert optim.weight_decay == 0.1 and loop.eval_interval == 20 and cfg.data.eval_split == "test"
    assert (cfg.run.backend, cfg.cluster.num_gpus, cfg.cluster.external_ray) == (
        "megatron",
        8,
        False,
    )
    assert cfg.model.model_name == "Qwen3-VL-8B-Instruct"
    assert cfg.data.dataset == "chenhegu/geo3k_imgurl"
    # miles' run_geo3k_vlm.sh: --num-rollout 3000, the problem as is (--input-key problem
    # --apply-chat-template), no --calculate-per-token-loss, evaluation at step 0
    assert (loop.num_rollout, cfg.data.template, loss.loss_agg_mode) == (
        3000,
        "none",
        "seq-mean-token-mean",
    )
    assert loop.eval_before_train
    # --wandb-group ${MODEL_NAME_LOWER}-${TRAIN_BACKEND} --disable-wandb-random-suffix
    assert cfg.run.wandb_group == cfg.run.wandb_run_name == "qwen3-vl-8b-instruct-megatron"
    fsdp = parse_grpo(["--backend", "fsdp", "--model-name", "Qwen3-VL-2B-Instruct"], env={})
    assert fsdp.run.wandb_group == "qwen3-vl-2b-instruct-fsdp"


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_sft_recipe_defaults(backend):
    """miles' run_geo3k_vlm_sft.sh: lr 1e-5, cosine to --min-lr 1e-6 after a 10 % warm-up
    (--lr-warmup-fraction 0.1), betas 0.9 / 0.95, 128 conversations a step; the warm-up's steps
    settle from the run's length."""
    cfg = parse_sft(["--backend", backend], env={})
    optim = cfg.trainer.optim
    assert (optim.lr, optim.lr_schedule, optim.min_lr, optim.warmup_fraction) == (
        1e-5,
        "cosine",
        1e-6,
        0.1,
    )
    assert tuple(optim.betas) == (0.9, 0.95) and optim.weight_decay == 0.1
    assert cfg.sft.sft_batch_size == 128 and cfg.data.template == "none"
    assert cfg.run.wandb_group == f"qwen3-vl-8b-instruct-{backend}"
    run = cfg.trainer.for_run(RunContext(model=None, seed=0, use_gpu=False, total_steps=500))
    assert run.optim.warmup_steps == 50


@pytest.mark.parametrize("prefix", ["GEO3K", "MILES_SCRIPT", "SLIME_SCRIPT"])
def test_recipe_environment_variables(prefix):
    env = {
        f"{prefix}_TRAIN_BACKEND": "fsdp",
        f"{prefix}_MODEL_NAME": "Qwen3-VL-4B-Instruct",
        f"{prefix}_DATASET_NAME": "/data/geo3k",
        f"{prefix}_NUM_GPUS": "4",
        f"{prefix}_EXTERNAL_RAY": "1",
    }
    for parse in (parse_grpo, parse_sft):
        cfg = parse([], env=env)
        assert (cfg.run.backend, cfg.cluster.num_gpus, cfg.cluster.external_ray) == (
            "fsdp",
            4,
            True,
        )
        assert (cfg.model.model_name, cfg.data.dataset) == ("Qwen3-VL-4B-Instruct", "/data/geo3k")
    # a flag beats the environment; our name beats the recipes' aliases
    assert parse_grpo(["--num-gpus", "2"], env=env).cluster.num_gpus == 2
    both = {"GEO3K_NUM_GPUS": "1", "MILES_SCRIPT_NUM_GPUS": "8"}
    assert parse_grpo([], env=both).cluster.num_gpus == 1


def test_tiny_preset_and_overrides():
    cfg = parse_grpo(["--preset", "tiny", "--num-rollout", "3", "--output-dir", "/tmp/x"], env={})
    assert (cfg.cluster.num_gpus, cfg.run.backend, cfg.model.model_name) == (
        0,
        "fsdp",
        "qwen3-vl-tiny",
    )
    assert cfg.loop.num_rollout == 3 and cfg.run.output_dir == "/tmp/x"
    assert cfg.warmup.warmup_sft_steps > 0 and cfg.data.dataset.startswith("synthetic")


def test_fsdp_options_reach_the_actor_config():
    def actor(argv: list[str]):
        cfg = parse_grpo(["--preset", "tiny", *argv], env={})
        return cfg.trainer.for_run(
            RunContext(model=cfg.model.model_name, seed=cfg.run.seed, use_gpu=False)
        )

    assert actor(["--fsdp-replicate", "--no-compile"]).replicate
    assert actor(["--fsdp-replicate", "--no-compile"]).compile is False
    assert not actor([]).replicate  # FSDP sharding unless asked


def test_megatron_options_reach_the_actor_config():
    """The miles / slime Megatron flags' counterparts: pipeline and expert parallelism, the
    recompute granularity (--gradient-checkpointing is full), the distributed optimizer."""

    def actor(argv: list[str]):
        # eight CPU ranks: room for every split below (the launcher checks the ranks divide)
        tiny = ["--preset", "tiny", "--backend", "megatron", "--cpu-trainers", "8"]
        cfg = parse_grpo([*tiny, *argv], env={})
        return cfg.trainer.for_run(
            RunContext(
                model=cfg.model.model_name,
                seed=cfg.run.seed,
                use_gpu=False,
                layout=cfg.parallel.trainer_layout(),
            )
        )

    default = actor([])
    assert (default.pp, default.ep, default.recompute, default.distributed_optimizer) == (
        1,
        1,
        "none",
        True,
    )
    argv = ["--pipeline-parallel", "2", "--expert-parallel", "4", "--recompute", "selective"]
    chosen = actor([*argv, "--no-distributed-optimizer"])
    assert (chosen.pp, chosen.ep, chosen.recompute, chosen.distributed_optimizer) == (
        2,
        4,
        "selective",
        False,
    )
    assert actor(["--gradient-checkpointing"]).recompute == "full"
    assert default.etp is None  # megatron-core's default: experts split like the rest (TP)
    assert actor(["--expert-parallel", "2", "--expert-tensor-parallel", "1"]).etp == 1
    assert actor(["--recompute", "full", "--gradient-checkpointing"]).recompute == "full"
    assert (default.cp, actor(["--context-parallel", "2", "--tensor-parallel", "2"]).cp) == (1, 2)
    # compile: the actor decides (on CUDA for dense Qwen3-VL) unless the flag says
    assert default.compile is None
    assert (actor(["--compile"]).compile, actor(["--no-compile"]).compile) == (True, False)


def test_the_fsdp_config_refuses_megatron_only_layouts():
    """Past the CLI check too (a launcher that builds the layout itself): FSDP shards, so
    it has no tensor, pipeline or expert (tensor) split to take."""
    cfg = parse_grpo(["--preset", "tiny", "--backend", "fsdp"], env={})
    base = RunContext(model=cfg.model.model_name, seed=0, use_gpu=False)
    settled = dataclasses.replace(base, layout=cfg.parallel.trainer_layout())
    assert cfg.trainer.for_run(settled).device == "cpu"
    for layout in (ParallelLayout(ep=2), ParallelLayout(etp=1), ParallelLayout(pp=2)):
        with pytest.raises(ValueError, match="for --backend megatron"):
            cfg.trainer.for_run(dataclasses.replace(base, layout=layout))


def test_sharded_fsdp_with_the_optimizer_on_the_host_is_refused_at_parse():
    """Two FSDP ranks shard the optimizer instead of stepping it on the host: the launcher
    says so before Ray starts (the actor's own refusal came only after the model loaded);
    replicated ranks hold it whole and may offload it."""
    argv = ["--preset", "tiny", "--backend", "fsdp", "--cpu-trainers", "2"]
    with pytest.raises(ConfigError, match=r"needs one GPU or --fsdp-replicate"):
        parse_grpo([*argv, "--optimizer-cpu-offload"], env={})
    cfg = parse_grpo([*argv, "--optimizer-cpu-offload", "--fsdp-replicate"], env={})
    assert cfg.parallel.offload_fraction == 1.0
    assert parse_grpo(argv, env={}).parallel.offload_fraction == 0.0


# the 2B shape on one H200, colocated with the transformers engine
ONE_H200 = ["--model-name", "qwen3-vl-2b", "--num-gpus", "1", "--gpu-memory-gib", "141"]
ISSUE_STEP = ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8"]
ISSUE_STEP += ["--global-batch-size", "128", "--rollout-max-response-len", "384"]


@pytest.mark.parametrize(
    ("argv", "offloads"),
    [
        # 39.6 GiB of trainer state leave the engine 45.7 GiB of KV cache for 19.2 needed
        # (FSDP, its gradients freed before the engine resumes: 27.7 GiB leave 51.6)
        ([*ISSUE_STEP, "--rollout-engine", "hf"], False),
        ([*ISSUE_STEP, "--rollout-engine", "hf", "--backend", "fsdp"], False),
        # the recipe's 64 x 8 responses of up to 4,096 tokens need 140 GiB of cache
        (["--rollout-engine", "hf"], True),
        # 80 GiB leave 15.2 GiB of cache beside the state
        ([*ISSUE_STEP, "--rollout-engine", "hf", "--gpu-memory-gib", "80"], True),
        # SGLang sizes its pool once at start
        ([*ISSUE_STEP, "--rollout-engine", "sglang"], True),
        ([*ISSUE_STEP, "--rollout-engine", "hf", "--offload-train"], True),
    ],
)
def test_offload_train_follows_the_memory_estimate(argv, offloads):
    """Unset, the trainer's state stays on the GPU during rollout only where the engine's KV
    cache beside it still holds the whole rollout; the choice is in `--print-config`."""
    cfg = parse_grpo([*ONE_H200, "--host-memory-gib", "128", *argv], env={})
    plan = colocation_plan(cfg)
    offload, why = plan.offload_train, plan.why
    assert offload is offloads and plan.optimizer_offload == 0, why
    if "GiB" in why:
        kept = "27.7" if "fsdp" in argv else "39.6"
        assert f"trainer state {kept} GiB" in why, why


def test_no_offload_train_is_kept():
    cfg = parse_grpo([*ONE_H200, "--rollout-engine", "hf", "--no-offload-train"], env={})
    plan = colocation_plan(cfg)
    assert (plan.offload_train, plan.why) == (False, "set")


@pytest.fixture(scope="module")
def qwen35_cut(tmp_path_factory) -> str:
    """A folder with the config of the Qwen3.5-35B-A3B cut to 8 layers (6 gated-delta-net, 2
    full-attention), the model issue 55's engine held a 1-token KV cache for on one H200."""
    from vlm_models.presets import preset_config

    folder = tmp_path_factory.mktemp("qwen35-cut")
    preset_config("qwen3.5-35b-a3b", num_hidden_layers=8).save_pretrained(folder)
    return str(folder)


def settled_plan(cfg):
    """The colocation plan of the layout the launcher settles on (as ``run`` and
    ``--print-config`` make it)."""
    from rl_runtime import plan_layout
    from vlm_models.sources import shape_of

    settled, _ = plan_layout(
        cfg.parallel,
        cfg.cluster,
        trainer=cfg.trainer,
        shape=shape_of(cfg.model),
        engines_park_weights=cfg.rollout.weights_cpu_backup,
    )
    return colocation_plan(dataclasses.replace(cfg, parallel=settled), cfg.parallel.offload_options)


def test_a_kl_penalty_s_reference_model_is_in_the_memory_plan(qwen35_cut):
    """--kl-coef > 0 keeps a frozen reference model, and the plan counts it: on Megatron a
    second bf16 copy of the weights on the GPU (2 bytes a parameter, between steps too, so the
    engine's KV cache is planned beside it), on FSDP float32 shards on the host (its GPU
    default, ``offload_reference``: 4 bytes a parameter of host memory, none on the GPU)."""
    from rl_runtime import plan_layout
    from vlm_models.sources import shape_of

    # one layout for both (left to itself, Megatron's plan moves 70 % of the optimizer to the
    # host with a reference, 60 % without; at 128 GiB of host memory it finds none)
    argv = ["--model-name", qwen35_cut, "--num-gpus", "1", "--gpu-memory-gib", "139.8"]
    argv += ["--host-memory-gib", "512", "--rollout-engine", "hf", *ISSUE_STEP]
    argv += ["--gradient-checkpointing", "--optimizer-cpu-offload"]
    argv += ["--optimizer-offload-fraction", "0.7"]

    def estimate(backend: str, *more: str):
        cfg = parse_grpo([*argv, "--backend", backend, *more], env={})
        shape = shape_of(cfg.model)
        settled, est = plan_layout(cfg.parallel, cfg.cluster, trainer=cfg.trainer, shape=shape)
        params = shape["language_params"] + shape["vision_params"]
        return cfg.trainer.reference_model, settled, est, params

    for backend, gpu, host in (("megatron", 2, 0), ("fsdp", 0, 4)):
        off, layout, plain, params = estimate(backend)
        on, same, kl, _ = estimate(backend, "--kl-coef", "0.001")
        assert (off, on) == (False, True)
        assert same == layout, backend
        assert kl.resident - plain.resident == pytest.approx(gpu * params), backend
        assert kl.weights - plain.weights == pytest.approx(gpu * params), backend
        assert kl.host - plain.host == pytest.approx(host * params), backend


def test_the_plan_sizes_the_engines_kv_cache_in_tokens(capsys, qwen35_cut):
    """Colocated with the transformers engine, the plan's KV-cache tokens (beside what the FSDP
    trainer keeps, less 128 sequences' gated-delta-net states: 12.4 MiB each) become the
    engine's cache_tokens, at most what its batch slots fill (256 x 1,408 tokens: a cache of
    half the free memory, 5.9M tokens for a rollout of 180,224, left the decode step no room
    beside a trainer that kept more than its estimate); --print-config shows them;
    --rollout-cache-tokens wins; fewer slots, a smaller cap; set --offload-train, the cache is
    planned beside nothing of the trainer's; without a plan (not colocated) the engine keeps
    sizing it by --kv-cache-fraction."""
    argv = ["--model-name", qwen35_cut, "--backend", "fsdp", "--num-gpus", "1"]
    argv += ["--gpu-memory-gib", "139.8", "--host-memory-gib", "128", "--rollout-engine", "hf"]
    argv += ISSUE_STEP
    with pytest.raises(SystemExit):
        parse_grpo([*argv, "--print-config"], env={})
    shown = json.loads(capsys.readouterr().out)["offload_train"]
    assert not shown["on"], shown
    assert "(360,448 tokens, what its 256 slots fill) beside them" in shown["why"], shown
    assert "1.5 GiB of it recurrent states" in shown["why"], shown
    assert shown["kv_cache_tokens"] == shown["cache_tokens"] == 256 * 1408, shown

    cfg = parse_grpo(argv, env={})
    assert cfg.rollout.cache_tokens is None
    plan = settled_plan(cfg)
    assert rollout_config(cfg, plan).cache_tokens == plan.kv_cache_tokens == 360_448

    given = parse_grpo([*argv, "--rollout-cache-tokens", "100000"], env={})
    assert rollout_config(given, settled_plan(given)).cache_tokens == 100_000
    with pytest.raises(SystemExit):
        parse_grpo([*argv, "--rollout-cache-tokens", "100000", "--print-config"], env={})
    shown = json.loads(capsys.readouterr().out)["offload_train"]
    assert (shown["kv_cache_tokens"], shown["cache_tokens"]) == (360_448, 100_000), shown

    fewer = parse_grpo([*argv, "--rollout-max-batch-size", "128"], env={})
    assert settled_plan(fewer).kv_cache_tokens == 128 * 1408

    offloaded = parse_grpo([*argv, "--offload-train"], env={})
    plan = settled_plan(offloaded)
    assert (plan.offload_train, plan.why) == (True, "set")
    assert plan.kv_cache_tokens == 360_448  # the cap, with the trainer's 70 GiB on the host
    assert rollout_config(offloaded, plan).cache_tokens == plan.kv_cache_tokens

    apart = parse_grpo([*argv, "--no-colocate", "--num-gpus", "2"], env={})
    plan = settled_plan(apart)
    assert plan.kv_cache_tokens is None
    assert rollout_config(apart, plan).cache_tokens is None


def _printed_layout(parse, argv, capsys) -> dict:
    with pytest.raises(SystemExit):
        parse([*argv, "--print-config"], env={})
    return json.loads(capsys.readouterr().out)["layout"]


def test_a_colocated_train_step_leaves_the_released_engine_its_gpu_memory(capsys, tmp_path):
    """The Qwen3.5-35B-A3B cut to 4 layers on one H100 (79.2 GiB), Megatron: the plan gave the
    step the whole GPU (76.8 GiB, no recompute) and the step ran out of memory beside the
    released engine's 3 GiB (2026-12-06). Colocated, the step's budget is the GPU less
    ENGINE_IDLE_BYTES, and the plan recomputes to fit it; an SFT run (no engine) and a trainer
    on GPUs of its own keep the whole GPU."""
    from vlm_models.presets import preset_config

    preset_config("qwen3.5-35b-a3b", num_hidden_layers=4).save_pretrained(tmp_path)
    argv = ["--model-name", str(tmp_path), "--backend", "megatron", "--num-gpus", "1"]
    argv += ["--gpu-memory-gib", "79.2", "--host-memory-gib", "125.8", "--rollout-engine", "hf"]
    colocated = _printed_layout(parse_grpo, [*argv, *ISSUE_STEP], capsys)
    assert (colocated["gpu_gib"], colocated["engine_idle_gib"]) == (79.2, 3.0), colocated
    assert colocated["total_gib"] <= 76.2 and "recompute" in colocated["description"], colocated
    assert "no recompute" not in colocated["description"], colocated

    alone = _printed_layout(parse_sft, argv[:-2], capsys)
    assert alone["gpu_gib"] == 79.2 and "engine_idle_gib" not in alone, alone
    apart = [*argv[:5], "2", *argv[6:], *ISSUE_STEP, "--no-colocate"]
    assert _printed_layout(parse_grpo, apart, capsys)["gpu_gib"] == 79.2


ONE_H200_8B = ["--model-name", "qwen3-vl-8b", "--num-gpus", "1", "--gpu-memory-gib", "140.4"]
ONE_H200_8B += ["--host-memory-gib", "128", "--rollout-engine", "hf", *ISSUE_STEP]


@pytest.mark.parametrize(("backend", "fraction"), [("fsdp", 0.5), ("megatron", 0.6)])
def test_8b_on_one_gpu_keeps_part_of_the_optimizer_on_the_host(capsys, backend, fraction):
    """The 8B shape on one H200 with 128 GiB of host memory: no layout holds its optimizer
    state on the GPU, so the launcher keeps the smallest tenth that fits on the host, says so
    in --print-config, and the trainer config gets that fraction; with the offload refused,
    the refusal suggests it. (Not colocated here: colocated, the fraction grows, below.)"""
    argv = [*ONE_H200_8B, "--backend", backend]
    with pytest.raises(SystemExit) as done:
        parse_grpo([*argv, "--print-config", "--no-colocate", "--num-gpus", "2"], env={})
    assert done.value.code == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert f"optimizer {fraction:.0%} on the host" in layout["description"], layout
    assert layout["fits"] and layout["host_gib"] <= layout["host_budget_gib"], layout
    assert layout["optimizer_cpu_offload"].startswith("chosen: no layout holds"), layout
    from rl_runtime import plan_layout
    from vlm_models.sources import shape_of

    cfg = parse_grpo(argv, env={})
    park = cfg.rollout.weights_cpu_backup  # as the launcher plans it (off: the engine drops them)
    settled, _ = plan_layout(
        cfg.parallel,
        cfg.cluster,
        trainer=cfg.trainer,
        shape=shape_of(cfg.model),
        engines_park_weights=park,
    )
    assert settled.optimizer_cpu_offload and settled.optimizer_offload_fraction == fraction
    actor = cfg.trainer.for_run(
        RunContext(model="qwen3-vl-8b", seed=0, use_gpu=True, layout=settled.trainer_layout())
    )
    assert actor.optimizer_offload == fraction
    cfg = parse_grpo([*argv, "--no-optimizer-cpu-offload"], env={})
    with pytest.raises(PreflightError, match=r"Try .*--optimizer-cpu-offload"):
        plan_layout(cfg.parallel, cfg.cluster, trainer=cfg.trainer, shape=shape_of(cfg.model))


# FSDP's layout puts 50 % of its optimizer on the host, Megatron's 60 % (above), raised to
# 80 % colocated (79.1 GiB); the host's 83.8 GiB for the trainer's state cannot hold 90 % (88.9)
@pytest.mark.parametrize(("backend", "fraction"), [("fsdp", 0.5), ("megatron", 0.8)])
def test_8b_colocated_keeps_its_state_on_the_gpu_with_more_optimizer_on_the_host(
    capsys, backend, fraction
):
    """Colocated, the 8B trainer's state stays on the GPU: FSDP's (its gradients freed before
    the engine resumes: 65.3 GiB) leaves the engine's KV cache a whole rollout at its layout's
    50 %; offloading Megatron's would need more host memory than 128 GiB leave (its optimizer
    is already partly there), so more of its optimizer goes there (60 % to 80 %, as much as
    the host holds under its 85 % cap) and the cache runs the rollout in turns; --print-config
    says so, and a fraction the user gives is kept."""
    from rl_runtime import plan_layout
    from vlm_models.sources import shape_of

    argv = [*ONE_H200_8B, "--backend", backend]
    with pytest.raises(SystemExit):
        parse_grpo([*argv, "--print-config"], env={})
    printed = json.loads(capsys.readouterr().out)
    shown, layout = printed["offload_train"], printed["layout"]
    assert not shown["on"], shown
    # the layout printed is the one the run holds: the fraction and its host memory
    assert f"optimizer {fraction:.0%} on the host" in layout["description"], layout
    if backend == "fsdp":  # the layout's own fraction
        assert "optimizer_offload_fraction" not in shown, shown
    else:  # the layout's 60 % raised to give the engine's KV cache room
        assert shown["optimizer_offload_fraction"] == fraction, shown
        assert (
            "60% of it on the host for the layout, raised to 80%" in layout["optimizer_cpu_offload"]
        ), layout
    if backend == "fsdp":
        assert shown["why"].startswith("trainer state 65.3 GiB"), shown
        assert "(192,056 tokens) beside them" in shown["why"], shown
    else:
        assert "offloading it would take" in shown["why"] and "in turns" in shown["why"], shown
    assert layout["fits"] and layout["host_gib"] <= layout["host_budget_gib"] == 83.8, layout
    cfg = parse_grpo(argv, env={})
    park = cfg.rollout.weights_cpu_backup
    settled, _ = plan_layout(
        cfg.parallel,
        cfg.cluster,
        trainer=cfg.trainer,
        shape=shape_of(cfg.model),
        engines_park_weights=park,
    )
    plan = colocation_plan(dataclasses.replace(cfg, parallel=settled), cfg.parallel.offload_options)
    assert (plan.offload_train, plan.optimizer_offload) == (False, fraction), plan.why
    given = parse_grpo([*argv, "--optimizer-offload-fraction", "0.6"], env={})
    settled, _ = plan_layout(
        given.parallel,
        given.cluster,
        trainer=given.trainer,
        shape=shape_of(given.model),
        engines_park_weights=park,
    )
    plan = colocation_plan(
        dataclasses.replace(given, parallel=settled), given.parallel.offload_options
    )
    assert (plan.offload_train, plan.optimizer_offload) == (False, 0.6), plan.why


def test_the_2b_step_keeps_the_optimizer_on_the_gpu():
    from rl_runtime import plan_layout
    from vlm_models.sources import shape_of

    cfg = parse_grpo([*ONE_H200, *ISSUE_STEP, "--host-memory-gib", "128"], env={})
    settled, estimate = plan_layout(
        cfg.parallel, cfg.cluster, trainer=cfg.trainer, shape=shape_of(cfg.model)
    )
    assert not settled.optimizer_cpu_offload and estimate is not None and estimate.host == 0


QWEN35 = ["--preset", "qwen3.5-35b-a3b"]


def test_qwen35_35b_a3b_preset_is_the_slime_layout(capsys, monkeypatch):
    """The slime recipe's 35B-A3B run: megatron TP2 + SP with whole experts over EP8, full
    recompute; one SGLang engine of 8 GPUs with EP8 and NEXTN speculative decoding; the
    layout estimated from the built-in shape before any download."""
    pytest.importorskip("transformers", minversion="5.2")  # Qwen3.5 configs
    cfg = parse_grpo(QWEN35, env={})
    layout = cfg.parallel.trainer_layout()
    actor = cfg.trainer.for_run(
        RunContext(model=cfg.model.model_name, seed=0, use_gpu=True, layout=layout)
    )
    assert (actor.tp, actor.sp, actor.pp, actor.ep, actor.etp) == (2, True, 1, 8, 1)
    assert actor.recompute == "full" and cfg.cluster.num_gpus == 8 and cfg.cluster.colocate
    engine = cfg.rollout.sglang_config()
    assert (cfg.rollout.backend, engine.tp_size, engine.mem_fraction_static) == ("sglang", 8, 0.7)
    expected = dict(
        ep_size=8,
        speculative_algorithm="EAGLE",
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
        enable_draft_weights_cpu_backup=True,
        max_running_requests=512,
        cuda_graph_bs_decode=[1, 2, 4, *range(8, 257, 8)],
    )
    assert engine.extra_args == expected
    assert engine.engine_kwargs()["ep_size"] == 8
    # what the rollout actors build: the whole rollout configuration reaches SGLang (built,
    # not run: SGLang is taken as installed)
    from rollout_sglang import launch

    monkeypatch.setattr(launch, "sglang_available", lambda: True)
    factory = launch.engine_factory(
        cfg.rollout, source="/models/Qwen3.5-35B-A3B", use_gpu=True, eos_token_ids=[1],
        pad_token_id=0, min_pixels=3136, max_pixels=1003520,
    )  # fmt: skip
    built = factory.args[0].sglang_config()
    assert built.extra_args == expected and built.tp_size == 8 and built.base_gpu_id == 0
    assert (built.min_pixels, built.max_pixels, built.model_path) == (
        3136, 1003520, "/models/Qwen3.5-35B-A3B"
    )  # fmt: skip
    assert cfg.reward.reward_type == "deepscaler"  # the script's --rm-type
    with pytest.raises(SystemExit) as done:
        parse_grpo([*QWEN35, "--print-config", "--gpu-memory-gib", "141"], env={})
    assert done.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"]["model_name"] == "Qwen3.5-35B-A3B"
    layout = printed["layout"]
    assert layout["description"].startswith("megatron TP2, EP8, ETP1, DP4, SP")
    assert layout["fits"] and 80 < layout["total_gib"] < 141, layout


QWEN35_REFUSED = [
    (["--num-gpus", "4"], r"multiples of --expert-parallel .* = 8, but --num-gpus 4 gives 4"),
    (["--num-gpus", "0"], r"multiples of --tensor-parallel .* = 2, but a CPU run has"),
    (["--no-colocate"], r"= 8, but --num-gpus 8 --no-colocate leaves 4 trainer rank"),
    (
        ["--num-gpus", "12", "--no-colocate", "--rollout-num-gpus", "4"],
        r"--rollout-num-gpus-per-engine 8 does not divide the 4 rollout GPUs",
    ),
    (["--backend", "fsdp"], r"--tensor-parallel / --sequence-parallel are for --backend megatron"),
    (["--sglang-ep-size", "3"], r"--sglang-ep-size 3 must divide --rollout-num-gpus-per-engine 8"),
    (
        ["--rollout-engine", "hf"],
        r"--sglang-ep-size / --sglang-speculative-algorithm / --sglang-cuda-graph-bs / "
        r"--sglang-max-running-requests: SGLang's; --rollout-engine hf has none",
    ),
]


@pytest.mark.parametrize(("argv", "message"), QWEN35_REFUSED)
def test_qwen35_35b_a3b_preset_refuses_what_cannot_run(argv, message):
    """At parse, before Ray or a download; a layout refusal names what the preset set."""
    pytest.importorskip("transformers", minversion="5.2")
    with pytest.raises(ConfigError, match=message) as err:
        parse_grpo([*QWEN35, *argv], env={})
    if "layout" in message or "rollout GPUs" in message or "multiples" in message:
        assert "--preset qwen3.5-35b-a3b sets this layout" in str(err.value)


def test_print_config_and_help_as_processes():
    out = subprocess.run(
        [sys.executable, "apps/geo3k_grpo", "--preset", "tiny", "--print-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["run"]["preset"] == "tiny"
    out = subprocess.run(
        [sys.executable, "apps/geo3k_sft", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--num-rollout" not in out.stdout and "--sft-num-steps" in out.stdout
    assert "GEO3K_TRAIN_BACKEND" in out.stdout


def test_preflight_stops_without_gpus(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    cfg = parse_grpo(["--output-dir", str(tmp_path)], env={})
    with pytest.raises(PreflightError, match=r"needs 8 GPU.*no GPU.*--preset tiny --num-gpus 0"):
        run_grpo(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_megatron_backend_is_checked_before_anything_starts(tmp_path, monkeypatch):
    """Without a Megatron actor the launcher stops at once and points at the FSDP backend."""
    import trainers_megatron.actor

    cfg = parse_grpo(
        ["--preset", "tiny", "--backend", "megatron", "--output-dir", str(tmp_path)], env={}
    )
    monkeypatch.delattr(trainers_megatron.actor, "MegatronActor")
    with pytest.raises(PreflightError, match="fsdp"):
        run_grpo(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()


MACHINE_REFUSALS = [
    ("geo3k_grpo", ["--rollout-engine", "sglang"], "--rollout-engine sglang"),
    ("geo3k_grpo", ["--weight-transport", "cuda-ipc"], "--weight-transport cuda-ipc"),
    ("geo3k_grpo", ["--weight-transport", "nccl"], "--weight-transport nccl"),
    ("geo3k_grpo", ["--attn-implementation", "flash_attention_2"], "flash_attention_2"),
    (
        "geo3k_sft",
        ["--backend", "megatron", "--linear-attention-kernels", "fla"],
        "--linear-attention-kernels fla",
    ),
]


@pytest.mark.parametrize(("app", "argv", "message"), MACHINE_REFUSALS)
def test_settings_this_machine_cannot_run_are_refused_before_any_work(tmp_path, app, argv, message):
    """SGLang without SGLang or a GPU, a GPU-only transport or kernel on a CPU run: refused by
    the preflight, before the SFT warm-up or Ray (they used to fail after the warm-up)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("these settings may run on a GPU machine")
    from geo3k_sft.main import run as run_sft

    parse, run = (parse_grpo, run_grpo) if app == "geo3k_grpo" else (parse_sft, run_sft)
    cfg = parse(["--preset", "tiny", "--output-dir", str(tmp_path), *argv], env={})
    with pytest.raises(PreflightError, match=re.escape(message)):
        run(cfg)
    assert list(tmp_path.iterdir()) == []  # no config, no warm-up, no metrics


def test_reward_options_are_checked_before_anything_starts():
    """A tolerance on the strict math reward stops parsing, naming the flags."""
    with pytest.raises(ConfigError, match="--reward-tolerance"):
        parse_grpo(["--preset", "tiny", "--reward-tolerance", "0.05"], env={})
    geo3k = parse_grpo(
        ["--preset", "tiny", "--reward-type", "geo3k", "--reward-tolerance", "0.05"], env={}
    )
    assert (geo3k.reward.reward_type, geo3k.reward.reward_tolerance) == ("geo3k", 0.05)


GRPO_BAD = [
    (["--num-rollout", "-3"], "--num-rollout -3: must be >= 1"),
    (["--global-batch-size", "0"], "--global-batch-size 0: must be >= 1"),
    (["--rollout-batch-size", "0"], "--rollout-batch-size 0: must be >= 1"),
    (["--lr", "nan"], "--lr nan: must be a finite number"),
    (["--lr", "0"], "--lr 0: must be > 0"),
    (["--rollout-temperature", "0"], "--rollout-temperature 0: must be > 0"),
    (["--rollout-top-p", "1.5"], "--rollout-top-p 1.5: must be > 0 and <= 1"),
    (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt 1: must be >= 2"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints -1: must be >= 0"),
    (["--adam-beta2", "1"], "--adam-beta2 1: must be >= 0 and < 1"),
    (["--eps-clip", "inf"], "--eps-clip inf: must be a finite number"),
    (["--kl-type", "k9"], "--kl-type k9: expected one of"),
    (["--reward-type", "exact"], "--reward-type exact: expected one of"),
    (["--template", "cot"], "--template cot: expected one of"),
    (["--global-batch-size", "48"], "--global-batch-size 48 must divide the 128 samples"),
    (["--tensor-parallel", "2"], "--tensor-parallel / --sequence-parallel are for --backend"),
    (["--pipeline-parallel", "2"], "--pipeline-parallel / --expert-parallel are for --backend"),
    (["--expert-tensor-parallel", "1"], "--expert-tensor-parallel is for --backend megatron"),
    (["--context-parallel", "2"], "--context-parallel is for --backend megatron"),
    (["--recompute", "selective"], "--recompute selective is for --backend megatron"),
    (["--gradient-checkpointing", "--recompute", "none"], "--recompute none contradicts"),
    (["--recompute", "some"], "--recompute some: expected one of"),
    (["--num-gpus", "4", "--no-colocate", "--rollout-num-gpus", "4"], "leaves no GPU"),
    (["--min-pixels", "100", "--max-pixels", "10"], "--min-pixels 100 is above --max-pixels"),
]


def test_a_dataset_that_is_not_there_is_a_config_error(tmp_path):
    """A folder without the split's files stops the run before Ray, naming --dataset."""
    argv = ["--preset", "tiny", "--warmup-sft-steps", "0", "--dataset", str(tmp_path)]
    cfg = parse_grpo([*argv, "--output-dir", str(tmp_path / "run")], env={})
    with pytest.raises(ConfigError, match=r"^--dataset / GEO3K_DATASET_NAME: no file for split"):
        run_grpo(cfg)


def test_template_choices_are_vlm_datas():
    from dataclasses import fields

    from vlm_data import TEMPLATES, DataConfig
    from vlm_data.prompts import apply_template

    (template,) = [f for f in fields(DataConfig) if f.name == "template"]
    assert set(template.metadata["choices"]) == set(TEMPLATES)
    for name in TEMPLATES:  # each one the prompt builder knows
        assert "x" in apply_template("x", name)


@pytest.mark.parametrize(("argv", "message"), GRPO_BAD)
def test_grpo_settings_are_checked_at_parse(argv, message):
    """Each of these used to start Ray (or even train and exit 0) before failing, if at all."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_grpo(["--preset", "tiny", *argv], env={})


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--sft-num-steps", "0"], {}, "--sft-num-steps 0: must be >= 1"),
        (["--sft-batch-size", "-1"], {}, "--sft-batch-size -1: must be >= 1"),
        (["--sft-keep-checkpoints", "-1"], {}, "--sft-keep-checkpoints -1: must be >= 0"),
        (["--weight-decay", "nan"], {}, "--weight-decay nan: must be a finite number"),
        ([], {"GEO3K_NUM_GPUS": "-1"}, "environment GEO3K_NUM_GPUS=-1: must be >= 0"),
        (
            [],
            {"SLIME_SCRIPT_NUM_GPUS": "x"},
            "SLIME_SCRIPT_NUM_GPUS=x: GPUs to use (0: CPU run); takes",
        ),
    ],
)
def test_sft_settings_are_checked_at_parse(argv, env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_sft(["--preset", "tiny", *argv], env=env)


@pytest.mark.slow  # five launcher processes, each importing torch
def test_config_errors_are_one_line_and_exit_2():
    """As a user runs them: a bad flag or variable is one stderr line naming it, exit status 2,
    no traceback; `--log-level DEBUG` shows the traceback. Started together (each imports torch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEO3K_")}
    cases = {
        "env": ("geo3k_grpo", ["--print-config"], {"GEO3K_NUM_GPUS": "abc"}, "GEO3K_NUM_GPUS"),
        "backend": ("geo3k_grpo", ["--backend", "foo"], {}, "--backend"),
        "range": ("geo3k_grpo", ["--preset", "tiny", "--num-rollout", "-3"], {}, "--num-rollout"),
        "sft": ("geo3k_sft", ["--sft-batch-size", "0"], {}, "--sft-batch-size"),
        "debug": ("geo3k_sft", ["--lr", "nan", "--log-level", "DEBUG"], {}, "--lr"),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, f"apps/{app}", *argv],
            cwd=ROOT,
            env=env | extra,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (app, argv, extra, _) in cases.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        app, _, _, flag = cases[name]
        if name == "debug":
            assert proc.returncode != 0 and "Traceback" in err and flag in err
            continue
        assert proc.returncode == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{app}: error: "), (name, err)
        assert flag in lines[0] and "Traceback" not in err and not out


@pytest.mark.parametrize("app", ["geo3k_grpo", "geo3k_sft"])
def test_resume_without_checkpoint_keeps_the_metrics(tmp_path, app):
    """--resume in a folder whose checkpoints are gone but whose metrics.jsonl has rows stops
    before Ray starts, says so, and leaves the rows as they were (it used to truncate them)."""
    from geo3k_sft.main import run as run_sft

    rows = "".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows)
    (tmp_path / "checkpoints").mkdir()
    parse, run = (parse_grpo, run_grpo) if app == "geo3k_grpo" else (parse_sft, run_sft)
    cfg = parse(["--preset", "tiny", "--resume", "--output-dir", str(tmp_path)], env={})
    with pytest.raises(ResumeError, match=r"3 rows \(up to step 3\)"):
        run(cfg)
    assert (tmp_path / "metrics.jsonl").read_text() == rows
    assert not (tmp_path / "sft_warmup").exists() and not (tmp_path / "config.json").exists()


def test_bad_rows_are_skipped_and_counted():
    """A row without an answer and one with a corrupt image are skipped, named and counted;
    the sampler fills its batch from the good rows."""
    from rl_runtime import PromptSampler
    from vlm_data.processor import tiny_processor
    from vlm_data.prompts import PromptBuilder
    from vlm_data.sources import RowSource
    from vlm_data.synthetic import make_synthetic_rows

    rows = make_synthetic_rows(6, task="color")
    rows[1] = {**rows[1], "answer": ""}
    rows[4] = {**rows[4], "images": [{"bytes": b"not a png", "path": "broken.png"}]}
    source = RowSource(rows, PromptBuilder(tiny_processor()))
    sampler = PromptSampler(source, seed=0, shuffle=False)
    batch = sampler.next_batch(4)
    assert [p.index for p in batch] == [0, 2, 3, 5]
    assert source.skipped == 2 and sampler.state.skipped == 2
    assert source.builder.stats["missing_answer"] == 1 and source.builder.stats["bad_image"] == 1


def test_wandb_offline(tmp_path, monkeypatch):
    """--wandb without network logs offline into the run folder."""
    pytest.importorskip("wandb")
    from rl_runtime import RunLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = RunLogger(tmp_path, wandb=True, wandb_project="glimpse-test", config={"a": 1})
    logger.log({"step": 1, "reward_mean": 0.5})
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_malformed_jsonl_lines_count_in_skipped_rows(tmp_path, monkeypatch):
    """Lines of a JSONL file that are not a JSON object never become rows; the sampler's
    ``skipped_rows`` (metrics.jsonl's ``skipped_rows``) counts them once, beside bad rows."""
    import tempfile

    from rl_runtime import PromptSampler
    from vlm_data import DataConfig
    from vlm_data.processor import tiny_processor
    from vlm_data.sources import prompt_source

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the cleaned copy goes
    rows = [{"problem": f"{i} + 1?", "answer": str(i + 1), "images": []} for i in range(4)]
    rows[2]["answer"] = ""  # a bad row: drawn, skipped, counted
    lines = [json.dumps(rows[0]), '{"problem": "torn', json.dumps(rows[1]), "[1]"]
    lines += [json.dumps(r) for r in rows[2:]]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    source = prompt_source(
        DataConfig(dataset=str(tmp_path), template="none"), tiny_processor(), "train"
    )
    sampler = PromptSampler(source, seed=0, shuffle=False)
    assert [p.answer for p in sampler.next_batch(3)] == ["1", "2", "4"]
    assert source.malformed_lines == 2 and sampler.state.skipped == 1
    assert sampler.skipped_rows == 3


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_the_logprob_gap_is_judged_by_the_coarsest_dtype(backend):
    """The alarm's band (rl_runtime.logprob_guard) is the coarsest of the engine's and the
    trainer's compute dtypes and the dtype the weights are pushed in: on the CPU both compute
    in float32, but the engine holds the weights the trainer pushes in bfloat16 (the tiny
    preset's gap after step 1 is bfloat16-sized, docs/reliability.md). Its levels are settings,
    and 0 turns the stop off."""
    cfg = parse_grpo(["--preset", "tiny", "--backend", backend], env={})
    assert compute_dtype(cfg, use_gpu=False) == "bfloat16"
    assert compute_dtype(cfg, use_gpu=True) == "bfloat16"
    pushed_f32 = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, export_dtype="float32")
    )
    assert compute_dtype(pushed_f32, use_gpu=False) == "float32"
    half = parse_grpo(
        ["--preset", "tiny", "--backend", backend, "--param-dtype", "float16"], env={}
    )
    half = dataclasses.replace(
        half, trainer=dataclasses.replace(half.trainer, export_dtype="float32")
    )
    assert compute_dtype(half, use_gpu=False) == "float16"
    set_ = parse_grpo(
        ["--preset", "tiny", "--logprob-gap-warn", "0.5", "--logprob-gap-stop", "0"], env={}
    )
    assert (set_.loop.logprob_gap_warn, set_.loop.logprob_gap_stop) == (0.5, 0)
    with pytest.raises(ConfigError, match=re.escape("--logprob-gap-warn 0: must be > 0")):
        parse_grpo(["--preset", "tiny", "--logprob-gap-warn", "0"], env={})
