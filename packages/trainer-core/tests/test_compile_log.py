"""A compile the first step pays for names itself and its time (issue 49: minutes of a first
step with nothing in the log about what compiled)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from trainer_core.compile_log import log_compiles


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + 1


@pytest.mark.slow  # dynamo's first trace: about 10 s of CPU
def test_each_compile_logs_the_region_and_its_seconds(caplog):
    """A module compiled as the trainers compile their layers (``module.compile``) and a
    compiled function (the log-prob kernels): one line each at their first call, none when
    called again with another shape (dynamic shapes: no recompile). ``aot_eager`` traces as
    inductor does without building kernels (seconds on a CPU)."""
    log_compiles()
    torch._dynamo.reset()  # drops dynamo's callbacks (as a test or a user's code may): the
    log_compiles()  # next call installs them again (a suite run lost every line without it)
    log_compiles()  # installed once: one line per compile, not two
    block = Block()
    block.compile(dynamic=True, backend="aot_eager")
    scale = torch.compile(_scale, backend="aot_eager", dynamic=True)
    with caplog.at_level(logging.INFO, logger="glimpse.progress"):
        for rows in (3, 5):
            block(torch.randn(rows, 4, requires_grad=True)).sum().backward()
            scale(torch.randn(rows))
    lines = [r.getMessage() for r in caplog.records if r.name == "glimpse.progress"]
    assert len(lines) == 2, lines
    here = r"\(test_compile_log\.py:\d+\)"
    assert re.fullmatch(rf"torch\.compile: Block\.forward {here} compiled in [\d.]+ s", lines[0])
    assert re.fullmatch(rf"torch\.compile: _scale {here} compiled in [\d.]+ s", lines[1])


# Triton's autotuner on a CPU: a jitted kernel whose launch does nothing, timed by a stand-in
# benchmark, as fla's kernels are tuned on a GPU (its CachedAutotuner runs Triton's autotuner).
AUTOTUNE = """
import logging, sys
import triton
from triton.runtime.autotuner import Autotuner
from trainer_core.compile_log import log_compiles

logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s", stream=sys.stdout)
log_compiles(triton_autotune=True)  # as the trainers and the engine do on a GPU

def kernel(x, T):
    pass

configs = [
    triton.Config({"BT": bt, "BK": bk}, num_warps=w, num_stages=s)
    for bt in (16, 32, 64, 128, 256) for bk in (32, 64, 128, 256, 512, 1024, 2048) for (w, s) in [(4, 2)]
]
for name in ("chunk_fwd_kernel_h", "chunk_bwd_kernel_dv", "fused_recurrent_fwd_kernel",
             "l2norm_fwd_kernel", "chunk_local_cumsum_kernel"):
    kernel.__name__ = kernel.__qualname__ = name
    jitted = triton.jit(kernel)
    jitted.run = lambda *args, **kwargs: None
    tuner = Autotuner(jitted, ["x", "T"], configs, key=["T"], reset_to_zero=None,
                      restore_value=None, do_bench=lambda call, quantiles: (call(), [1.0] * 3)[1])
    tuner.run(None, 4096)
    tuner.run(None, 4096)  # the same key again: tuned already, nothing to say
"""


@pytest.mark.slow  # a fresh process that imports torch and triton: about 10 s of CPU
def test_a_triton_autotune_is_one_line_naming_the_kernel_and_its_seconds(tmp_path):
    """Before: Triton's own print, one line per config timed and four for the result: 195
    lines for these five kernels of 35 configs (175 in one GPU run of fla's kernels)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    # Triton's interpreter (TRITON_INTERPRET, which rollout-sglang's conftest sets for the
    # whole session) launches no compiled kernel and is not the path a GPU run tunes on
    unset = ("TRITON_PRINT_AUTOTUNING", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    script = tmp_path / "autotune.py"  # a file: triton.jit reads the kernel's source
    script.write_text(AUTOTUNE)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 5, lines[:10]
    for line, name in zip(lines, ("chunk_fwd_kernel_h", "chunk_bwd_kernel_dv"), strict=False):
        assert re.fullmatch(
            rf"LOG glimpse\.progress Triton autotune: {name} \(key \(4096,\)\) timed 35 "
            r"config\(s\) in [\d.]+ s, chose BT: 16, BK: 32, num_warps: 4, .*",
            line,
        ), line
