"""bf16 parity on a CUDA GPU (skipped elsewhere): the tiny preset, TP=1.

The 2B-shape figure comes from ``tools/bench/bench_megatron_parity.py --device cuda``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu


@torch.no_grad()
def test_bf16_logits_close_to_hf_on_cuda(tiny_setup, to_megatron_inputs):
    from vlm_models.build import build_model
    from vlm_models.megatron import (
        Parallelism,
        build_megatron_model,
        initialize_model_parallel,
        load_hf_weights,
    )

    config, reference, batch = tiny_setup
    initialize_model_parallel(Parallelism())
    hf = build_model(config, dtype=torch.bfloat16).cuda().eval()
    hf.load_state_dict(reference.state_dict())
    model = build_megatron_model(config, Parallelism(), params_dtype=torch.bfloat16).cuda().eval()
    load_hf_weights(model, hf.state_dict())
    inputs = to_megatron_inputs(config, batch)
    sbhd = {k: v.cuda() for k, v in inputs["sbhd"].items()}
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    got = model(**sbhd).float()
    expected = hf(**cuda_batch).logits.float()
    fp32 = copy.deepcopy(reference).cuda()(**cuda_batch).logits.float()
    valid = inputs["valid"].cuda()
    diff = (got - expected)[valid].abs().max()
    noise = (expected - fp32)[valid].abs().max()  # bf16's own error against float32
    assert diff <= max(2 * noise, 1e-2), f"megatron vs hf {diff}, hf bf16 vs fp32 {noise}"
