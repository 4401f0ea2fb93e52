"""Real multi-process FSDP on CPU (gloo): two ranks give the one-rank gradients."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out: Path, timeout: float = 300.0) -> dict:
    """Run ``fsdp_worker.py`` as ``world`` processes with torchrun's environment variables."""
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
                [sys.executable, str(WORKER), "--out", str(out)],
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
        assert p.returncode == 0, log[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_two_process_fsdp_matches_one_process(tmp_path):
    """Uneven shards (rank 1 has no image, fewer micro-batches) still give the same gradient."""
    one = _launch(1, tmp_path / "one.pt")
    two = _launch(2, tmp_path / "two.pt")
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    step1, step2 = one.pop("train_step"), two.pop("train_step")
    assert step2["grad_norm"] == pytest.approx(step1["grad_norm"], rel=1e-5)
    # Adam divides by sqrt(v): where a gradient is ~0, reduction-order noise can flip an
    # element's update (+-lr). The update must agree on (nearly) every element and never differ
    # by more than that.
    lr = 1e-2
    for name, p in step1["params"].items():
        diff = (step2["params"][name] - p).abs()
        off = (diff > 1e-5).float().mean().item()
        assert diff.max() <= 2 * lr + 1e-6 and off <= 0.01, f"{name}: {diff.max():.2e}, {off:.2%}"
    cases = [k for k in one if k != "logprobs"]
    assert len(cases) == 3
    for case in cases:
        g1, g2 = one[case]["grads"], two[case]["grads"]
        assert g1.keys() == g2.keys() and g1
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-4, msg=name)
        m1, m2 = one[case]["metrics"], two[case]["metrics"]
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
        assert m2["tokens"] == m1["tokens"] and m2["loss_tokens"] == m1["loss_tokens"]
