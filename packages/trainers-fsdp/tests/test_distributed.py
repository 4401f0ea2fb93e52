"""Real multi-process FSDP on CPU (gloo): two ranks give the one-rank gradients.

Two launches serve every test: one rank running each one-rank scenario, two ranks running
each two-rank scenario in turn (``fsdp_worker.py``; the processes' imports cost more than a
scenario's work).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")
# The first test waits for a launch of every scenario (on 2 busy cores, minutes).
pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out: Path, scenarios: dict, timeout: float = 600.0) -> dict:
    """Run ``fsdp_worker.py`` as ``world`` processes with torchrun's environment variables:
    every scenario (name -> the worker's flags) in turn; rank 0's results by name."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",  # as torchrun sets it: one thread per rank
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--out", str(out), "--case", json.dumps(scenarios)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"rank {procs.index(p)}: " + log[-4000:]
    return torch.load(out, weights_only=False)


def _assert_same_update(params: dict, other: dict, lr: float = 1e-2, close: float = 1e-5) -> None:
    """Adam divides by sqrt(v): where a gradient is ~0, reduction-order noise can flip an
    element's update (+-lr). The update must agree (within ``close``) on nearly every element
    and never differ by more than that."""
    for name, p in params.items():
        diff = (other[name] - p).abs()
        off = int((diff > close).sum())
        allowed = max(1, diff.numel() // 100)  # 1 %, or one element of a small tensor
        assert diff.max() <= 2 * lr + 1e-6 and off <= allowed, f"{name}: {diff.max():.2e}, {off}"


def _assert_same_logprobs_and_grads(one: dict, two: dict) -> None:
    """The worker's log-probs and each case's gradients agree between two launches."""
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    cases = [k for k in one if k not in ("logprobs", "train_step")]
    assert len(cases) == 3
    for case in cases:
        g1, g2 = one[case]["grads"], two[case]["grads"]
        assert g1.keys() == g2.keys() and g1
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-4, msg=name)


MOE_REPLAY = ["--model", "qwen3-vl-moe-tiny", "--routing-replay"]
#: the scenarios run on one rank, the references of the two-rank runs of the same name
ONE_RANK = {"fsdp": [], "qwen3_5": ["--model", "qwen3.5-tiny"], "moe_replay": MOE_REPLAY}
TWO_RANKS = {
    **ONE_RANK,
    "replicate": ["--replicate"],
    **{
        f"bf16_{reduce}{suffix}": ["--bf16", "--reduce-dtype", reduce, *flags]
        for reduce in ("float32", "bfloat16")
        for suffix, flags in (("", []), ("_replicate", ["--replicate"]))
    },
    # "checkpoint": ["--replicate", "--checkpoint", folder], added by the fixture
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return _launch(1, tmp_path_factory.mktemp("one") / "one.pt", ONE_RANK)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("two")
    checkpoint = ["--replicate", "--checkpoint", str(tmp / "ckpt")]
    return _launch(2, tmp / "two.pt", TWO_RANKS | {"checkpoint": checkpoint})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "replicate"])
def test_two_processes_match_one_process(one_process, two_processes, name):
    """Uneven shards (rank 1 has no image, fewer micro-batches) still give the same gradient,
    sharded by FSDP or replicated and averaged by one all-reduce."""
    one = dict(one_process["fsdp"])
    two = dict(two_processes[name])
    _assert_same_logprobs_and_grads(one, two)
    step1, step2 = one.pop("train_step"), two.pop("train_step")
    assert step2["grad_norm"] == pytest.approx(step1["grad_norm"], rel=1e-5)
    _assert_same_update(step1["params"], step2["params"])
    for case in [k for k in one if k != "logprobs"]:
        m1, m2 = one[case]["metrics"], two[case]["metrics"]
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
        assert m2["tokens"] == m1["tokens"] and m2["loss_tokens"] == m1["loss_tokens"]


@pytest.mark.slow
def test_qwen3_5_two_processes_match_one_process(one_process, two_processes):
    """Qwen3.5 sharded over two ranks: rows packed differently than on one rank (and rank 1's
    text-only rows with the dummy image sample) give the same log-probs and gradients, so the
    gated delta net's state stays inside each sample under FSDP too."""
    _assert_same_logprobs_and_grads(one_process["qwen3_5"], two_processes["qwen3_5"])


@pytest.mark.slow
def test_routing_replay_two_processes_match_one_process(one_process, two_processes):
    """MoE routed to the engine's experts under FSDP: sharded layers, rows packed otherwise
    and rank 1's dummy image sample (its filler ids) give one rank's log-probs and gradients."""
    _assert_same_logprobs_and_grads(one_process["moe_replay"], two_processes["moe_replay"])


@pytest.mark.slow
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_replicated_bf16_masters_match_fsdp(two_processes, reduce_dtype):
    """Two ranks in bf16 over float32 masters: replicated (flat buffers, one all-reduce of the
    float32 accumulator, or of the bf16 gradient itself) gives FSDP's gradients, grad norm and
    updated parameters under the same reduce dtype."""
    fsdp = dict(two_processes[f"bf16_{reduce_dtype}"])
    replicated = dict(two_processes[f"bf16_{reduce_dtype}_replicate"])
    for a, b in zip(fsdp["logprobs"], replicated["logprobs"], strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    tol = dict(atol=1e-7, rtol=1e-5)
    step_f, step_r = fsdp.pop("train_step"), replicated.pop("train_step")
    rel = 1e-5 if reduce_dtype == "float32" else 1e-2
    assert step_r["grad_norm"] == pytest.approx(step_f["grad_norm"], rel=rel)
    # gradients equal to float32 rounding (or bf16 noise, summed in another order), so Adam's
    # update may flip where a gradient is ~0 (see _assert_same_update)
    close = 1e-5 if reduce_dtype == "float32" else 2e-4
    _assert_same_update(step_f["params"], step_r["params"], close=close)
    for case in [k for k in fsdp if k != "logprobs"]:
        g_f, g_r = fsdp[case]["grads"], replicated[case]["grads"]
        assert g_f.keys() == g_r.keys() and g_f
        for name in g_f:
            if reduce_dtype == "float32":
                torch.testing.assert_close(g_r[name], g_f[name], **tol, msg=name)
            else:  # FSDP rounds each micro-batch's sum to bf16, the flat path only the total
                err = (g_r[name] - g_f[name]).norm()
                assert err <= 1e-2 * g_f[name].norm() + 1e-6, f"{name}: {err:.2e}"


@pytest.mark.slow
def test_replicated_checkpoint_resumes_exactly(two_processes):
    """Two replicated ranks save (DCP keeps one copy of what they both hold); a fresh actor
    resumed from it takes the same next step to the bit."""
    out = two_processes["checkpoint"]
    expected, resumed = out["resume"]["losses"]
    assert resumed == expected
    kept, fresh = out["resume"]["params"]
    assert kept.keys() == fresh.keys() and kept
    for name, p in kept.items():
        assert torch.equal(fresh[name], p), name
