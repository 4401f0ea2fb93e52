"""The trainer step written once (rl_algos.train_step) gives the same step on both backends.

Two gloo processes run one GRPO step with one loss object on the FSDP actor (two data-parallel
ranks) and on the Megatron actor (TP=1 as two data-parallel ranks; TP=2 with sequence
parallelism), float32 on CPU, several micro-batches per rank, from the same tiny random
weights. Log-probs before the step, the step's metrics (means, minima and maxima over
micro-batches and ranks) and the HF-named weights after it agree; a step with NaN advantages is
skipped and counted on both.
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
BACKENDS = ("fsdp", "megatron_tp1", "megatron_tp2")


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
    if backend == "megatron_tp2":
        return results[0][backend][key]
    return results[0][backend][key] + results[1][backend][key]


def test_logprobs_agree(results):
    fsdp = _whole(results, "fsdp", "before")
    for backend in BACKENDS[1:]:
        for a, b in zip(fsdp, _whole(results, backend, "before"), strict=True):
            assert float((a - b).abs().max()) < 1e-5, backend


def test_one_loss_object_gives_the_same_metrics(results):
    ref = results[0]["fsdp"]["metrics"]
    assert ref["num_micro_batches"] >= 2  # per rank: the loop and its scaling are exercised
    assert ref["clip_frac"] > 0 and ref["ratio_min"] < 0.9 < 1.1 < ref["ratio_max"]
    keys = ("loss", "pg_loss", "clip_frac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl")
    for backend in BACKENDS[1:]:
        for r in range(2):
            got = results[r][backend]["metrics"]
            for k in keys:
                assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), (backend, k)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), backend
            assert got["tokens"] == ref["tokens"] and got["loss_tokens"] == ref["loss_tokens"]
            assert set(got) == set(ref), backend  # the same metrics, declared once


def test_weights_after_one_step_agree(results):
    ref = results[0]["fsdp"]["after"]
    assert results[0]["fsdp"]["moved"] > 5e-5  # the step moved the weights (LR 1e-4)
    for backend in BACKENDS[1:]:
        got = results[0][backend]["after"]
        assert set(got) == set(ref), backend
        worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        assert worst < 1e-5, (backend, worst)


def test_nonfinite_step_is_skipped_and_counted(results):
    for backend in BACKENDS:
        for r in range(2):
            res = results[r][backend]
            assert res["nonfinite"]["update_skipped"] == 1.0, backend
            assert res["nonfinite"]["grad_norm"] != res["nonfinite"]["grad_norm"]  # NaN
            assert res["unchanged"], backend  # the weights are those of the step before
            assert res["step"] == 2 and res["nonfinite"]["step"] == 2.0
