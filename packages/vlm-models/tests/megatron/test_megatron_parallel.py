"""Multi-process parity: two real processes over gloo, float32 on CPU.

One launch of two ranks runs every scenario (imports dominate the cost):

* ``tp2``: tensor parallel; logits, gradients of every TP-sharded tensor and of the vision
  tower against HF's (converted with the same ``shard``), and the HF-named export;
* ``tp2_sp``: tensor + sequence parallel, padded batch;
* ``tp2_sp_thd``: tensor + sequence parallel on packed THD sequences;
* ``pp2``: two pipeline stages (vision and deepstack on the first, tied output layer copy on
  the last), and the export across stages;
* ``pp2_train``: the same two stages, forward and backward with activations and their
  gradients exchanged between stages, gradients of both stages against HF's;
* ``moe_ep2`` / ``moe_tp2_sp``: the MoE preset with experts over two expert-parallel ranks, or
  over two tensor-parallel ranks with sequence parallelism; logits and export;
* ``q35_*``: Qwen3.5 (gated delta net + gated attention) dense at TP=2 (logits, gradients of
  every TP-sharded tensor, export) and TP=2 + SP on packed rows, and MoE (shared expert) at
  EP=2 (logits, export), TP=2 + SP, and TP=2 + SP with whole experts over EP=2 (expert TP 1,
  the recipe's 35B-A3B layout). The tiny presets have one KV head; these runs give them
  two (and four query heads), since the conversion splits whole KV groups over TP.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_models.presets import PRESETS

ATOL = 1e-5
GRAD_RTOL = 1e-4
WORKER = Path(__file__).with_name("dist_worker.py")
SCENARIOS = {
    "tp2": dict(tp=2, pp=1, grads=True, export=True),
    "tp2_sp": dict(tp=2, pp=1, sp=True),
    "tp2_sp_thd": dict(tp=2, pp=1, sp=True, thd=True),
    # 3 + 1 layers: all three deepstack layers on the first stage.
    "pp2": dict(tp=1, pp=2, export=True, overrides={"num_layers_in_first_pipeline_stage": 3}),
    # Forward and backward across the two stages, gradients against HF's.
    "pp2_train": dict(
        tp=1, pp=2, pipeline_grads=True, overrides={"num_layers_in_first_pipeline_stage": 3}
    ),
    # MoE: experts split over two expert-parallel ranks, or over two (expert) TP ranks + SP.
    "moe_ep2": dict(tp=1, pp=1, ep=2, model="moe", export=True),
    "moe_tp2_sp": dict(tp=2, pp=1, sp=True, model="moe", export=True),
    "q35_tp2": dict(tp=2, pp=1, grads=True, export=True, model="q35"),
    "q35_tp2_sp_thd": dict(tp=2, pp=1, sp=True, thd=True, model="q35"),
    "q35moe_ep2": dict(tp=1, pp=1, ep=2, model="q35moe", export=True),
    "q35moe_tp2_sp": dict(tp=2, pp=1, sp=True, model="q35moe"),
    # the slime recipe's 35B-A3B layout in small: attention over TP=2, whole experts over EP=2
    "q35moe_tp2_sp_ep2_etp1": dict(tp=2, pp=1, sp=True, ep=2, etp=1, model="q35moe", export=True),
}
Q35_IDS = dict(
    vocab_size=151936,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    num_key_value_heads=2,
    num_attention_heads=4,
)
# A_log and dt_bias set each head's decay; their gradient sums every token's through exp and
# softplus and is ill-conditioned in float32: transformers' own float32 gradient is off its
# float64 one by up to 4e-3 of a two-head slice's largest entry (measured, this model), and a
# full-suite run met 3.0e-2 on A_log (other layers unchanged): held to 5e-2.
DECAY_GRAD_RTOL = 5e-2

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tiny_setup, to_megatron_inputs, make_hf_model, tmp_path_factory):
    """Launch the two ranks once; return (reference, per-rank results)."""
    from vlm_models.presets import tiny_config

    config, hf_model, batch = tiny_setup
    moe_config = tiny_config("qwen3-vl-moe-tiny")
    moe_model = make_hf_model(moe_config, seed=7)
    with torch.no_grad():
        moe_logits = moe_model(**batch).logits
    inputs = to_megatron_inputs(config, batch)
    hf_model.zero_grad()
    logits = hf_model(**batch).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    weights[~inputs["valid"]] = 0.0  # padding positions are not compared
    (logits * weights).sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in hf_model.named_parameters()}
    hf_model.zero_grad()
    models = {
        "dense": dict(config=config, hf_state=dict(hf_model.state_dict())),
        "moe": dict(config=moe_config, hf_state=dict(moe_model.state_dict())),
    }
    references = {"dense": logits.detach(), "moe": moe_logits}
    if "qwen3.5-tiny" in PRESETS:
        for name, preset, seed in (("q35", "qwen3.5-tiny", 11), ("q35moe", "qwen3.5-moe-tiny", 12)):
            q35_config = tiny_config(preset, **Q35_IDS)
            q35 = make_hf_model(q35_config, seed=seed)
            q35_logits = q35(**batch).logits
            (q35_logits * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in q35.named_parameters()}
            q35.zero_grad()
            models[name] = dict(config=q35_config, hf_state=dict(q35.state_dict()), hf_grads=grads)
            references[name] = q35_logits.detach()
    scenarios = {k: v for k, v in SCENARIOS.items() if v.get("model", "dense") in models}
    case = dict(
        models=models,
        sbhd=inputs["sbhd"],
        thd=inputs["thd"],
        hidden=config.text_config.hidden_size,
        scenarios=scenarios,
        loss_weights=weights,
        hf_grads=hf_grads,
    )
    workdir = tmp_path_factory.mktemp("megatron_dist")
    torch.save(case, workdir / "case.pt")
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(workdir / "case.pt"), str(workdir)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-6000:]}"
    results = [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    reference = dict(
        logits=logits.detach(),
        moe_logits=moe_logits,
        by_model=references,
        valid=inputs["valid"],
        hf_state={name: m["hf_state"] for name, m in models.items()},
        configs={name: m["config"] for name, m in models.items()},
    )
    return reference, results


@pytest.mark.parametrize("scenario", ["tp2", "tp2_sp"])
def test_padded_batch_logits_match_hf(run, scenario):
    reference, results = run
    for rank in range(2):  # every TP rank holds the gathered logits
        got = results[rank][scenario]["logits"]
        diff = (got - reference["logits"])[reference["valid"]].abs().max()
        assert diff < ATOL, f"{scenario} rank {rank}: max |diff| {diff}"


def test_packed_thd_with_sequence_parallel_matches_hf(run):
    reference, results = run
    expected = reference["logits"][reference["valid"]]
    got = results[0]["tp2_sp_thd"]["logits"][0]
    assert (got - expected).abs().max() < ATOL


def test_pipeline_parallel_logits_match_hf(run):
    reference, results = run
    assert "logits" not in results[0]["pp2"]  # the first stage returns hidden states
    got = results[1]["pp2"]["logits"]
    assert (got - reference["logits"])[reference["valid"]].abs().max() < ATOL


def test_tensor_parallel_gradients_match_hf(run):
    _, results = run
    for rank in range(2):
        errors = results[rank]["tp2"]["grad_rel_err"]
        assert any(n.endswith("linear_qkv.weight") for n in errors)
        assert any(n.startswith("visual.") for n in errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] < GRAD_RTOL, f"rank {rank}: {worst} relative error {errors[worst]}"


def test_pipeline_schedule_gradients_match_hf(run):
    _, results = run
    errors = {**results[0]["pp2_train"]["grad_rel_err"], **results[1]["pp2_train"]["grad_rel_err"]}
    assert any(n.startswith("visual.") for n in errors)  # first stage
    assert "language_model.decoder.final_layernorm.weight" in errors  # last stage
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_RTOL, f"{worst} relative error {errors[worst]}"


@pytest.mark.parametrize("scenario", ["moe_ep2", "moe_tp2_sp"])
def test_moe_logits_match_hf(run, scenario):
    reference, results = run
    for rank in range(2):
        got = results[rank][scenario]["logits"]
        diff = (got - reference["moe_logits"])[reference["valid"]].abs().max()
        assert diff < ATOL, f"{scenario} rank {rank}: max |diff| {diff}"


def _qwen35(reference) -> None:
    if "q35" not in reference["by_model"]:
        pytest.skip("Qwen3.5 needs a newer transformers")


@pytest.mark.parametrize(
    "scenario", ["q35_tp2", "q35moe_ep2", "q35moe_tp2_sp", "q35moe_tp2_sp_ep2_etp1"]
)
def test_qwen35_logits_match_hf(run, scenario):
    """Gated delta net heads, A_log, dt_bias and conv over TP; MoE with a shared expert."""
    reference, results = run
    _qwen35(reference)
    expected = reference["by_model"][SCENARIOS[scenario]["model"]]
    for rank in range(2):
        diff = (results[rank][scenario]["logits"] - expected)[reference["valid"]].abs().max()
        assert diff < ATOL, f"{scenario} rank {rank}: max |diff| {diff}"


def test_qwen35_packed_rows_with_sequence_parallel_match_hf(run):
    reference, results = run
    _qwen35(reference)
    expected = reference["by_model"]["q35"][reference["valid"]]
    for rank in range(2):
        assert (results[rank]["q35_tp2_sp_thd"]["logits"][0] - expected).abs().max() < ATOL


def test_qwen35_tensor_parallel_gradients_match_hf(run):
    reference, results = run
    _qwen35(reference)
    for rank in range(2):
        errors = results[rank]["q35_tp2"]["grad_rel_err"]
        for part in ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "linear_qkv.weight"):
            assert any(n.endswith(part) for n in errors), part
        for name, error in errors.items():
            decay = name.endswith(("A_log", "dt_bias"))
            assert error < (DECAY_GRAD_RTOL if decay else GRAD_RTOL), f"rank {rank}: {name} {error}"


def test_expert_tensor_parallel_one_keeps_each_expert_whole(run):
    """At TP=2 the experts are split like the rest (expert TP defaults to TP); with expert
    TP 1 over EP=2 each rank holds half the experts, each whole (the recipe's layout)."""
    reference, results = run
    _qwen35(reference)
    cfg = reference["configs"]["q35moe"].text_config
    for rank in range(2):
        split = results[rank]["q35moe_tp2_sp"]["expert_fc1"]
        whole = results[rank]["q35moe_tp2_sp_ep2_etp1"]["expert_fc1"]
        assert split and whole
        per_layer = cfg.num_experts // 2 * cfg.num_hidden_layers
        assert len(whole) == len(split) // 2 == per_layer
        gate_up = 2 * cfg.moe_intermediate_size
        assert {s[0] for s in split.values()} == {gate_up // 2}
        assert {s[0] for s in whole.values()} == {gate_up}


@pytest.mark.parametrize(
    "scenario",
    ["tp2", "pp2", "moe_ep2", "moe_tp2_sp", "q35_tp2", "q35moe_ep2", "q35moe_tp2_sp_ep2_etp1"],
)
def test_hf_named_export_is_bit_exact(run, scenario):
    reference, results = run
    model = SCENARIOS[scenario].get("model", "dense")
    if model not in reference["hf_state"]:
        pytest.skip("Qwen3.5 needs a newer transformers")
    hf_state = reference["hf_state"][model]
    tied = model == "dense"
    expected = {k: v for k, v in hf_state.items() if not (tied and k == "lm_head.weight")}
    for rank in range(2):
        exported = results[rank][scenario]["exported"]
        assert set(exported) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), f"{scenario} rank {rank}: {name}"
