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
