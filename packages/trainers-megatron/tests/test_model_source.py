"""What the Megatron actor starts from: a folder's weights, or random ones only when a preset
name asks for them. A missing folder, a folder without weights or an unreachable hub id stop
the actor before it joins any process group (it used to train a random model silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch.distributed as dist

from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor
from vlm_models import ModelSourceError
from vlm_models.presets import tiny_config


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("missing", r"no such file or directory"),
        ("config_only", r"no weights.*preset"),
        ("glimpse-tests/no-such-model-xyz", r"'glimpse-tests/no-such-model-xyz'.*local folder"),
    ],
)
def test_unloadable_source_is_an_error_not_random_weights(tmp_path: Path, source, message):
    if source == "missing":
        source = str(tmp_path / "missing")
    elif source == "config_only":
        tiny_config().save_pretrained(tmp_path)
        source = str(tmp_path)
    from megatron.core import parallel_state

    # an earlier test in this process may hold a process group: compare, do not assume none
    before = (dist.is_initialized(), parallel_state.model_parallel_is_initialized())
    with pytest.raises(ModelSourceError, match=message):
        MegatronActor(MegatronConfig(model=source))
    # refused before any process group or model-parallel state was set up
    assert (dist.is_initialized(), parallel_state.model_parallel_is_initialized()) == before


def test_expert_parallel_on_a_dense_model_is_refused_before_any_process_group():
    from megatron.core import parallel_state

    before = (dist.is_initialized(), parallel_state.model_parallel_is_initialized())
    with pytest.raises(ValueError, match=r"ep=2 .*needs an MoE model"):
        MegatronActor(MegatronConfig(model="qwen3-vl-tiny", ep=2))
    assert (dist.is_initialized(), parallel_state.model_parallel_is_initialized()) == before
