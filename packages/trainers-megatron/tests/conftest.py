"""What the Megatron actor tests share: a world of one in the test process, and gloo ranks
run as worker scripts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process():
    """A world of one on a free port (the actor initialises the process group itself)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        yield
    from vlm_models.megatron import destroy_model_parallel

    destroy_model_parallel()


def run_ranks(worker: Path, workdir: Path, world: int, **env: str) -> list[Any]:
    """``worker case.pt workdir`` as ``world`` gloo ranks (``env`` added to each), each
    writing ``rank{r}.pt``; their results, in rank order. A failed rank fails the test with
    its log's tail."""
    base = dict(
        os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(workdir / "case.pt"), str(workdir)],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-6000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="session")
def launch_ranks():
    """:func:`run_ranks` (test modules are imported by path: they take it as a fixture)."""
    return run_ranks
