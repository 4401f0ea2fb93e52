"""The in-process SGLang engine against a stand-in for ``sglang.Engine`` (sglang cannot run on
a CPU): the methods and answers of sglang 0.5.23 ``srt/entrypoints/engine.py``, with the
session rule of ``srt/managers/scheduler_components/weight_updater.py``."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rollout_sglang.sglang_client.common import SGLangConfig
from rollout_sglang.sglang_client.engine import SGLangEngine
from weight_sync.weight_names import WeightNameCheck


@dataclass
class FlushCacheReqOutput:  # managers/io_struct.py
    success: bool
    message: str = ""


class EngineLike:
    """``Engine`` methods we call; each answers what the real one answers."""

    def __init__(self) -> None:
        self.session = False
        self.calls: list[str | tuple] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.payloads: list[list[str]] = []
        self.running = 0

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append("begin")
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append("tensor")
        if not self.session:
            return False, (
                "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()"
            )
        if load_format == "flattened_bucket":
            # entrypoints/engine.py _serialize_tensors_per_rank: pre-serialized payloads, one
            # per TP rank, passed through as they are (base64 strings or pickle bytes)
            assert all(isinstance(p, str | bytes) for p in named_tensors), named_tensors
            self.payloads.append(list(named_tensors))
        else:
            self.loaded.update(dict(named_tensors))
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")
        return FlushCacheReqOutput(success=self.running == 0, message="requests running")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))


def _engine(**kwargs) -> tuple[SGLangEngine, EngineLike]:
    like = EngineLike()
    return SGLangEngine(SGLangConfig(model_path="m"), engine=like, **kwargs), like


def test_issue21_item1_inprocess_update_runs_in_one_session():
    engine, like = _engine()
    buckets = [[("model.norm.weight", torch.ones(2))], [("lm_head.weight", torch.zeros(3))]]
    engine.update_weights(buckets)
    assert like.calls == ["begin", "tensor", "tensor", "end", "flush"]
    assert set(like.loaded) == {"model.norm.weight", "lm_head.weight"}
    engine.update_weights(buckets[:1])  # the session was closed: the next one opens
    assert like.calls[-4:] == ["begin", "tensor", "end", "flush"]


def test_a_failed_bucket_still_closes_the_session():
    names = WeightNameCheck.from_names(["model.norm.weight"])
    engine, like = _engine(weight_names=names)
    good, bad = ("model.norm.weight", torch.ones(2)), ("model.nrom.weight", torch.ones(2))
    with pytest.raises(ValueError, match="nrom"):
        engine.update_weights([[good], [bad]])
    assert like.calls == ["begin", "tensor", "end"] and not like.session


def test_serialized_buckets_pass_through_inside_the_callers_session():
    """What the CUDA IPC transport calls per bucket (``cuda_ipc._load_serialized``): SGLang's
    ``flattened_bucket`` payloads, as they are, inside the session the transport opened."""
    names = WeightNameCheck.from_names(["model.norm.weight"])
    engine, like = _engine(weight_names=names)
    with pytest.raises(RuntimeError, match="between begin_weight_update"):
        engine.update_weights_from_serialized(["model.norm.weight"], ["cGF5bG9hZA=="])
    engine.begin_weight_update()
    engine.update_weights_from_serialized(["model.norm.weight"], ["cGF5bG9hZA=="])
    assert like.payloads[-1] == ["cGF5bG9hZA=="]
    with pytest.raises(ValueError, match="nrom"):  # refused before anything is sent
        engine.update_weights_from_serialized(["model.nrom.weight"], ["eA=="])
    engine.end_weight_update()
    assert like.calls == ["tensor", "begin", "tensor", "end"]


def test_refused_flush_is_an_error():
    engine, like = _engine()
    like.running = 1
    with pytest.raises(RuntimeError, match="flush_cache failed"):
        engine.flush_cache()


def test_smoke_script_help_runs_without_sglang():
    script = Path(__file__).resolve().parents[3] / "tools" / "sglang_smoke.py"
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "--server-gpu" in done.stdout


def test_memory_comes_back_by_parts():
    """`resume_memory(tags)` reaches `sglang.Engine.resume_memory_occupation(tags=...)`: the
    colocated loop takes the weights back for the push and the KV cache after the trainer's
    state left the GPU (as slime does). Only released types are asked for (SGLang refuses the
    others): an engine never released, or already resumed, is not asked again."""
    engine, like = _engine()
    engine.resume_memory(("kv_cache",))  # never released (a restarted engine): nothing asked
    engine.release_memory()
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache", "cuda_graph"))
    engine.resume_memory()  # all back already
    engine.release_memory()
    engine.resume_memory()
    assert [c for c in like.calls if isinstance(c, tuple)] == [
        ("release", None),
        ("resume", ["weights"]),
        ("resume", ["kv_cache", "cuda_graph"]),
        ("release", None),
        ("resume", ["kv_cache", "weights", "cuda_graph"]),
    ]
