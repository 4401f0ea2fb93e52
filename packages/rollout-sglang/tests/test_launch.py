"""The launcher's engine factory builds the transformers engine in the precision it serves in.

Found on the H200 (2026-12-02): the factory built the engine's model in float32, so the
colocated GRPO step decoded at 31 ms a step (float32 matmuls, a float32 KV cache) where the
engine's own benchmark, in bfloat16, took 8.5 ms on the same prompts.
"""

from __future__ import annotations

import pytest
import torch

from rollout_sglang import RolloutConfig
from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.launch import engine_factory
from vlm_models.presets import tiny_config


def _factory(dtype: str, **settings):
    cfg = RolloutConfig(
        model_path="unused", backend="hf", max_batch_size=4, dtype=dtype, **settings
    )
    return engine_factory(
        cfg, source=tiny_config(), use_gpu=False, eos_token_ids=[151645], pad_token_id=0
    )


def test_factory_passes_the_rollout_dtype():
    factory = _factory("float16")
    assert factory.args[0].dtype == "float16"


def test_factory_passes_the_engine_settings():
    """The launcher's transformers engine gets every engine flag (the factory once passed the
    batch size and dtype alone, so --decode-attention never reached it)."""
    engine = _factory("float32", decode_attention="matmul", kv_cache_fraction=0.3)()
    try:
        assert engine.max_batch_size == 4
        assert engine.decoder.attention == "matmul"
        assert engine._kv_cache_fraction == 0.3
        assert not engine.weights_backup  # dropped at release, refilled by the push
    finally:
        engine.shutdown()
    backed = _factory("float32", weights_cpu_backup=True)()
    try:
        assert backed.weights_backup
    finally:
        backed.shutdown()
    legacy = _factory("float32", legacy_decode=True)()
    try:
        assert legacy._legacy is not None
    finally:
        legacy.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rule")
def test_cpu_engine_stays_float32():
    engine = _factory("bfloat16")()
    try:
        assert isinstance(engine, HFEngine)
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_serves_in_the_rollout_dtype():
    engine = _factory("bfloat16")()
    try:
        dtypes = {p.dtype for p in engine.model.parameters()}
        assert dtypes == {torch.bfloat16}
        assert next(engine.model.parameters()).is_cuda
    finally:
        engine.shutdown()


def test_weights_cpu_backup_reaches_sglang_too():
    """One setting for both engines: SGLang keeps its released weights on the host only with
    enable_weights_cpu_backup (sglang 0.5.23, model_runner_components/load_model_utils.py)."""
    assert "enable_weights_cpu_backup" not in RolloutConfig().server_args()
    assert RolloutConfig(weights_cpu_backup=True).server_args()["enable_weights_cpu_backup"]
