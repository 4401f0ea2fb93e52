"""What the launchers load and on which layout, settled in the driver before Ray or any model
starts: hub names resolved (and refused at once without a network), the memory estimate on the
real Qwen3-VL shapes, and a layout that cannot fit refused before any GPU memory is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from geo3k_grpo.main import parse as parse_grpo
from geo3k_grpo.main import run as run_grpo
from rl_runtime import (
    ModelShape,
    ParallelLayout,
    PreflightError,
    TrainLayout,
    estimate_memory,
    plan_layout,
)
from trainers_fsdp import FsdpConfig
from vlm_models import ModelSourceError
from vlm_models.flops import parameter_counts
from vlm_models.presets import preset_config
from vlm_models.sources import model_config, model_source, resolve_model, shape_of
from vlm_models.sources import model_shape as shape_numbers

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def model_shape(config) -> ModelShape:
    return ModelShape(**shape_numbers(config))


def plan(cfg):
    """The launcher's layout plan of a parsed config: (parallel settings, estimate)."""
    shape = shape_of(cfg.model, load=cfg.run.load)
    return plan_layout(cfg.parallel, cfg.cluster, trainer=cfg.trainer, shape=shape)


def _launch(app: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"apps/{app}", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---------------------------------------------------------------------------------- loading


@pytest.mark.slow
@pytest.mark.parametrize(
    ("app", "backend", "offline"),
    [
        ("geo3k_grpo", "fsdp", False),
        ("geo3k_grpo", "megatron", True),
        ("geo3k_sft", "megatron", False),
    ],
)
def test_hub_name_without_network_stops_at_once(tmp_path, app, backend, offline):
    """This machine has no route to the hub (and HF_HUB_OFFLINE=1 in one case): the launcher
    exits with status 2 and one line naming the id and suggesting a local folder, before it
    creates the run folder or starts Ray; no traceback, no random model."""
    env = {"HF_HOME": str(tmp_path / "hf_home")}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = tmp_path / "run"
    args = ["--model-name", "Qwen3-VL-8B-Instruct", "--backend", backend, "--num-gpus", "0"]
    proc = _launch(app, [*args, "--output-dir", str(out)], **env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{app}: error: --model-name: model 'Qwen/Qwen3-VL-8B-Instruct'"), last
    assert "local folder" in last
    assert ("HF_HUB_OFFLINE is set" if offline else "not reachable") in last
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_names_resolve_to_presets_folders_and_run_folders(tmp_path, qwen3vl_dir):
    cfg = parse_grpo(["--model-name", "qwen3-vl-2b", "--tokenizer", str(qwen3vl_dir)], env={})
    resolved = resolve_model(cfg.model)
    assert (resolved.model_name, resolved.tokenizer) == ("qwen3-vl-2b", str(qwen3vl_dir))
    assert model_source(resolved) == "qwen3-vl-2b"  # the trainers' random init
    with pytest.raises(ModelSourceError, match=r"shape preset.*--tokenizer"):
        resolve_model(parse_grpo(["--model-name", "qwen3-vl-2b"], env={}).model)
    # the shared folder has a config but no weights: never a silent random model
    no_weights = parse_grpo(["--model-name", str(qwen3vl_dir)], env={})
    with pytest.raises(ModelSourceError, match=r"no weights.*preset"):
        resolve_model(no_weights.model)
    missing = parse_grpo(["--model-name", str(tmp_path / "nope")], env={})
    with pytest.raises(ModelSourceError, match=r"--model-name: .*no such file or directory"):
        resolve_model(missing.model)


# ---------------------------------------------------------------------------------- layout


def test_shapes_from_the_real_configs(qwen3vl_dir, shared_dir):
    """The 8B reference architecture and the 4B config.json give the presets' shapes; the
    memory estimate reads them, vision tower included."""
    from transformers import AutoConfig

    ref_8b = shared_dir / "models" / "reference-configs" / "qwen3-vl-8b-architecture.json"
    real_8b = model_shape(AutoConfig.from_pretrained(ref_8b))
    assert real_8b == model_shape(preset_config("qwen3-vl-8b"))
    assert real_8b.vision_params == 576_388_336 and real_8b.vision_depth == 27
    real_4b = model_shape(AutoConfig.from_pretrained(qwen3vl_dir))
    assert real_4b == model_shape(preset_config("qwen3-vl-4b"))
    assert real_4b.language_params + real_4b.vision_params == pytest.approx(4.44e9, rel=0.01)
    two = parameter_counts(preset_config("qwen3-vl-2b"))
    assert model_shape(preset_config("qwen3-vl-2b")).language_params == two["language"]
    # one GPU of 80 GiB cannot hold the 4B model's AdamW training state (20 bytes/parameter)
    whole = TrainLayout(1, 4096, ParallelLayout(recompute="full"))
    one_gpu = estimate_memory(real_4b, FsdpConfig(), whole)
    assert one_gpu.weights + one_gpu.gradients + one_gpu.optimizer > 80 * GiB
    # a rollout token's bf16 keys and values: 36 layers x 8 KV heads x 128 (the 4B config)
    assert real_4b.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_kv_bytes_count_only_full_attention_layers():
    """Qwen3.5's gated-delta-net layers hold a state per sequence, not per token: 10 of the
    35B-A3B's 40 layers cache keys and values (2 KV heads of 256)."""
    pytest.importorskip("transformers", minversion="5.2")
    assert (
        shape_numbers(preset_config("qwen3.5-35b-a3b"))["kv_bytes_per_token"]
        == 2 * 10 * 2 * 256 * 2
    )


def test_unset_layout_is_chosen_and_shown_by_print_config(capsys):
    """The 8B recipe on 8 GPUs: unset, the layout becomes the first that fits. On 80 GB GPUs,
    less the 3 GiB a released colocated engine keeps, TP1 + recompute (78.3 GiB) does not fit:
    with the distributed optimizer (the default) that is TP2 + SP + recompute; with the
    optimizer state whole on every rank the miles recipe's TP4 + SP + recompute. --print-config
    shows it with the estimate and both memories."""
    argv = ["--model-name", "Qwen3-VL-8B-Instruct", "--gpu-memory-gib", "80"]
    cfg = parse_grpo(argv, env={})
    assert model_config(cfg.model).text_config.hidden_size == 4096  # no download
    parallel, estimate = plan(cfg)
    chosen = (parallel.tensor_parallel, parallel.sequence_parallel)
    assert (*chosen, parallel.gradient_checkpointing) == (2, True, True)
    assert estimate is not None and estimate.total <= 77 * GiB
    plain, _ = plan(parse_grpo([*argv, "--no-distributed-optimizer"], env={}))
    chosen = (plain.tensor_parallel, plain.sequence_parallel, plain.gradient_checkpointing)
    assert chosen == (4, True, True)
    with pytest.raises(SystemExit) as done:
        parse_grpo([*argv, "--print-config"], env={})
    assert done.value.code == 0
    shown = json.loads(capsys.readouterr().out)["layout"]
    assert shown["description"].startswith(
        "megatron TP2, DP4, SP, distributed optimizer, recompute"
    )
    assert shown["fits"] is True and (shown["gpu_gib"], shown["engine_idle_gib"]) == (80.0, 3.0)
    fsdp, _ = plan(parse_grpo([*argv, "--backend", "fsdp"], env={}))
    assert fsdp.gradient_checkpointing is True  # FSDP keeps its backend and recomputes


def test_layout_that_cannot_fit_is_refused_before_gpu_memory(tmp_path):
    """TP1 asked for explicitly: refused with the numbers and a suggestion, before the GPU
    count, the run folder, Ray or CUDA."""
    import torch

    cfg = parse_grpo(
        [
            *("--model-name", "qwen3-vl-8b", "--backend", "megatron", "--tensor-parallel", "1"),
            *("--gpu-memory-gib", "141", "--output-dir", str(tmp_path / "run")),
        ],
        env={},
    )
    refused = r"does not fit in 138\.0 GiB per GPU \(141\.0 less 3\.0 a released engine keeps\)"
    with pytest.raises(PreflightError, match=refused + ".*Try --backend megatron"):
        run_grpo(cfg)
    assert not torch.cuda.is_initialized()
    assert not (tmp_path / "run").exists()


#: The SFT launcher on a machine that shows 8 GPUs: the count the launcher asks the CUDA driver
#: for (``rl_runtime.preflight.count_gpus``, also bound in ``rl_runtime.parallel``) stands in
#: for them, so the layout check after the GPU check is reached on a CPU.
EIGHT_GPUS = """
import runpy, sys
import rl_runtime.parallel, rl_runtime.preflight
rl_runtime.preflight.count_gpus = rl_runtime.parallel.count_gpus = lambda: 8
sys.argv = ["apps/geo3k_sft", *sys.argv[1:]]
runpy.run_path("apps/geo3k_sft", run_name="__main__")
"""


@pytest.mark.slow
def test_layout_refusal_as_a_process(tmp_path, qwen3vl_dir):
    argv = [
        *("--model-name", "qwen3-vl-8b", "--tokenizer", str(qwen3vl_dir)),
        *("--backend", "megatron", "--tensor-parallel", "1", "--num-gpus", "8"),
        *("--gpu-memory-gib", "141", "--output-dir", str(tmp_path / "run")),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", EIGHT_GPUS, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "qwen3-vl-8b (8.77B parameters) does not fit" in last
    # a layout that fits is named (with the distributed optimizer: TP1 and recompute)
    assert "Try --backend megatron --tensor-parallel 1 --gradient-checkpointing" in last
    assert "Traceback" not in proc.stderr
