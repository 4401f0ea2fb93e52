"""The trainer step written once (rl_algos.train_step) gives the same step on both backends.

Two gloo processes run one GRPO step with one loss object on the FSDP actor (two data-parallel
ranks) and on the Megatron actor in every layout it trains with (``trainer_core_worker.SCENARIOS``:
two data-parallel ranks with megatron-core's distributed optimizer; TP=2 with sequence
parallelism and the plain optimizer; two pipeline stages under megatron-core's 1F1B schedule;
full and selective recomputation; the MoE preset with its experts over two expert-parallel
ranks, against FSDP on the same MoE), float32 on CPU, several micro-batches per rank, from the
same tiny random weights. Log-probs before the step, the step's metrics (means, minima and
maxima over micro-batches and ranks) and the HF-named weights after it agree; recomputation
gives the gradients of none; a step with NaN advantages is skipped and counted on all; three
steps with a KL penalty to the reference give the same ``kl_loss`` on both.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("trainer_core_worker.py")
#: each Megatron scenario and the FSDP run it must match
REFERENCE = {
    "megatron_tp1": "fsdp",
    "megatron_tp2": "fsdp",
    "megatron_pp2": "fsdp",
    "megatron_full": "fsdp",
    "megatron_selective": "fsdp",
    "megatron_moe_ep2": "fsdp_moe",
}
WHOLE_BATCH = ("megatron_tp2", "megatron_pp2")  # one replica: both ranks hold every sample


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("trainer_core")
    env = dict(
        os.environ,
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(workdir)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-6000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _whole(results: list[dict], backend: str, key: str) -> list[torch.Tensor]:
    """Per-sample tensors of the whole batch (data-parallel halves joined)."""
    if backend in WHOLE_BATCH:
        return results[0][backend][key]
    return results[0][backend][key] + results[1][backend][key]


@pytest.mark.parametrize("backend", REFERENCE)
def test_logprobs_agree(results, backend):
    fsdp = _whole(results, REFERENCE[backend], "before")
    for a, b in zip(fsdp, _whole(results, backend, "before"), strict=True):
        assert float((a - b).abs().max()) < 1e-5


@pytest.mark.parametrize("backend", REFERENCE)
def test_one_loss_object_gives_the_same_metrics(results, backend):
    ref = results[0][REFERENCE[backend]]["metrics"]
    assert ref["num_micro_batches"] >= 2  # per rank: the loop and its scaling are exercised
    assert ref["clip_frac"] > 0 and ref["ratio_min"] < 0.9 < 1.1 < ref["ratio_max"]
    keys = ("loss", "pg_loss", "clip_frac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl")
    for r in range(2):  # every rank (every pipeline stage) reports the global metrics
        got = results[r][backend]["metrics"]
        for k in keys:
            assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert got["tokens"] == ref["tokens"] and got["loss_tokens"] == ref["loss_tokens"]
        # the same metrics, declared once (a step run in two halves is not timed)
        assert set(got) | {"perf/train_step_s", "tokens_per_s"} == set(ref)


@pytest.mark.parametrize("backend", REFERENCE)
def test_weights_after_one_step_agree(results, backend):
    ref = results[0][REFERENCE[backend]]["after"]
    assert results[0][REFERENCE[backend]]["moved"] > 5e-5  # the step moved them (LR 1e-4)
    for r in range(2):  # full HF tensors on every rank: each stage / expert rank gave its part
        got = results[r][backend]["after"]
        assert set(got) == set(ref)
        worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        assert worst < 1e-5, worst


@pytest.mark.parametrize("mode", ["megatron_full", "megatron_selective"])
def test_recompute_gives_the_gradients_of_none(results, mode):
    for r in range(2):
        none, got = results[r]["megatron_tp1"], results[r][mode]
        assert set(got["grads"]) == set(none["grads"])
        scale = max(float(g.abs().max()) for g in none["grads"].values())
        assert scale > 0
        worst = max(float((got["grads"][k] - g).abs().max()) for k, g in none["grads"].items())
        assert worst <= 1e-6 * scale, worst
        # the core attention really ran again in the backward (once per layer and micro-batch)
        assert got["attention_calls"] == 2 * none["attention_calls"] > 0


def test_distributed_optimizer_shards_its_state(results):
    """Each data-parallel rank keeps AdamW moments for about half of the parameters."""
    held = [results[r]["megatron_tp1"]["optimizer_numel"] for r in range(2)]
    total = held[0][1]
    assert all(0.4 * total < h < 0.6 * total for h, _ in held), held
    assert total <= held[0][0] + held[1][0] < 1.01 * total  # all of them, padding aside


def test_experts_are_split_over_the_expert_parallel_ranks(results):
    assert [results[r]["megatron_moe_ep2"]["local_experts"] for r in range(2)] == [4, 4]
    assert results[0]["megatron_tp1"]["local_experts"] == 0  # dense: no experts


def test_nonfinite_step_is_skipped_and_counted(results):
    for backend in ["fsdp", "fsdp_moe", *REFERENCE]:
        for r in range(2):
            res = results[r][backend]
            assert res["nonfinite"]["update_skipped"] == 1.0, backend
            assert res["nonfinite"]["grad_norm"] != res["nonfinite"]["grad_norm"]  # NaN
            assert res["unchanged"], backend  # the weights are those of the step before
            assert res["step"] == 2 and res["nonfinite"]["step"] == 2.0


def test_kl_to_the_reference_is_the_same_on_both_backends(results):
    """Three on-policy steps with ``kl_coef`` 0.01 against the frozen initial weights: the
    reference log-probs reach the loss on Megatron as on FSDP. At step 1 the policy is the
    reference (KL 0); after it, ``kl_loss`` grows and agrees to a relative 1e-5 (float32 sums
    of ~100 per-token terms in different orders differ around 1e-7)."""
    for r in range(2):
        fsdp, megatron = (
            [m["kl_loss"] for m in results[r]["kl"][b]] for b in ("fsdp", "megatron_tp1")
        )
        # step 1: the same weights; train and eval forwards may differ by float32 rounding
        # (|log-ratio| < 1e-5), and k3 of that is under its square, 5e-11
        assert abs(fsdp[0]) < 1e-9 and abs(megatron[0]) < 1e-9, (fsdp, megatron)
        assert 1e-3 < fsdp[1] < fsdp[2], fsdp  # the policy leaves the reference
        assert megatron[1:] == pytest.approx(fsdp[1:], rel=1e-5), (megatron, fsdp)
