"""Qwen3.5 (gated delta net + gated full attention, dense and MoE) on Megatron-Core, one process.

The reference is transformers' Qwen3.5 model on the same (perturbed) weights and real geo3k
inputs. Tolerance 1e-4 absolute on logits of magnitude ~2 (the issue's bound; measured ~2e-6).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from safetensors.torch import load_file, save_file

from vlm_models.megatron import (
    Parallelism,
    SafetensorsReader,
    build_megatron_model,
    hf_state_dict_to_megatron,
    hf_to_megatron_checkpoint,
    initialize_model_parallel,
    load_hf_weights,
    megatron_shards_to_hf,
    megatron_to_hf_checkpoint,
    text_arch,
    transformer_config,
)
from vlm_models.megatron.gated_delta_net import PackedGatedDeltaNet, packs_samples
from vlm_models.presets import PRESETS, tiny_config

pytestmark = pytest.mark.skipif("qwen3.5-tiny" not in PRESETS, reason="needs Qwen3.5")

ATOL = 1e-4
# Qwen3.5-tiny speaks Qwen3.5's token ids; the test inputs come from the Qwen3-VL processor.
QWEN3_VL_IDS = dict(
    vocab_size=151936,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)


def qwen35_config(preset: str, **overrides):
    return tiny_config(preset, **QWEN3_VL_IDS, **overrides)


@pytest.fixture(scope="module")
def tp1():
    initialize_model_parallel(Parallelism())


@pytest.fixture(scope="module", params=["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def setup(request, tiny_setup, make_hf_model, to_megatron_inputs):
    """(config, HF model, processor batch, Megatron inputs, HF logits) of one preset."""
    _, _, batch = tiny_setup
    config = qwen35_config(request.param)
    hf_model = make_hf_model(config, seed=5)
    with torch.no_grad():
        logits = hf_model(**batch).logits
    return config, hf_model, batch, to_megatron_inputs(config, batch), logits


def _megatron(config, hf_model):
    model = build_megatron_model(config, Parallelism()).eval()
    load_hf_weights(model, hf_model.state_dict())
    return model


def _packed(cu: torch.Tensor) -> PackedSeqParams:
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip


def test_config_maps_qwen35_onto_megatron_fields():
    config = transformer_config(qwen35_config("qwen3.5-moe-tiny"))
    assert config.experimental_attention_variant == "gated_delta_net"
    assert config.linear_attention_freq == [1, 1, 1, 0]  # 3 gated-delta-net layers, 1 attention
    assert config.attention_output_gate and config.layernorm_zero_centered_gamma
    assert config.moe_shared_expert_intermediate_size == 32 and config.moe_shared_expert_gate
    assert config.moe_router_dtype == "fp32"  # as slime's Qwen3.5 MoE script
    assert text_arch(qwen35_config("qwen3.5-tiny")).rotary_dim == 16  # a quarter of head_dim 64
    with pytest.raises(ValueError, match="num_key_value_heads 1 not divisible by tp=2"):
        transformer_config(qwen35_config("qwen3.5-tiny"), Parallelism(tp=2))


@torch.no_grad()
def test_logits_match_hf(tp1, setup):
    config, hf_model, _, inputs, expected = setup
    model = _megatron(config, hf_model)
    layers = model.language_model.decoder.layers
    assert [isinstance(layer.self_attention, PackedGatedDeltaNet) for layer in layers] == [
        True, True, True, False,
    ]  # fmt: skip
    got = model(**inputs["sbhd"])
    valid = inputs["valid"]
    assert got.shape == expected.shape
    assert (got - expected)[valid].abs().max() < ATOL
    assert expected[valid].abs().max() > 0.5  # not a comparison of near-zero tensors


@torch.no_grad()
def test_packed_rows_match_per_sample_hf(tp1, setup):
    """Samples end to end in one THD row: each one's logits are those it gets alone."""
    config, hf_model, _, inputs, expected = setup
    model = _megatron(config, hf_model)
    assert model.packs_samples
    thd = dict(inputs["thd"])
    packed = _packed(thd.pop("cu_seqlens"))
    got = model(**thd, packed_seq_params=packed)[0]
    assert (got - expected[inputs["valid"]]).abs().max() < ATOL


@torch.no_grad()
def test_state_carried_across_samples_would_be_caught(tp1, setup, monkeypatch):
    """Negative control: a gated delta net that ignores the boundaries moves the second
    sample's logits far beyond the tolerance (the first sample's stay put)."""
    config, hf_model, _, inputs, expected = setup
    model = _megatron(config, hf_model)
    thd = dict(inputs["thd"])
    cu = thd.pop("cu_seqlens")
    monkeypatch.setattr(
        PackedGatedDeltaNet, "_boundaries", staticmethod(lambda params, b, s: [0, s])
    )
    got = model(**thd, packed_seq_params=_packed(cu))[0]
    diff = (got - expected[inputs["valid"]]).abs().max(dim=-1).values
    first = int(cu[1])
    assert diff[:first].max() < ATOL
    assert diff[first:].max() > 100 * ATOL


def test_a_layer_that_cannot_pack_is_reported(tp1, setup):
    config, hf_model, *_ = setup
    model = _megatron(config, hf_model)
    assert packs_samples(model)
    model.language_model.decoder.layers[0].self_attention.packs_samples = False
    assert not model.packs_samples


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_in_memory_round_trip_is_bit_exact(make_hf_model, preset, tp, pp):
    config = qwen35_config(preset, num_key_value_heads=2, num_attention_heads=4)
    hf = make_hf_model(config, seed=2).state_dict()
    arch = text_arch(config)
    shards = hf_state_dict_to_megatron(hf, arch, tp_size=tp, pp_size=pp)
    assert len(shards) == tp * pp
    back = megatron_shards_to_hf(shards, arch)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@torch.no_grad()
def test_folders_round_trip_with_the_mtp_head_and_load(tp1, setup, tmp_path):
    """HF folder -> Megatron TP=2 PP=2 shards -> HF folder: every tensor bit-exact, the MTP
    head (not part of the trained model) kept as read; the folder streams into a live model
    that reproduces transformers' logits."""
    config, hf_model, _, inputs, expected = setup
    hf_model.save_pretrained(tmp_path / "hf")
    (weights,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    mtp = {  # the shapes of a Qwen3.5 checkpoint's MTP head, at this size
        "mtp.fc.weight": torch.randn(64, 128, generator=gen),
        "mtp.norm.weight": torch.randn(64, generator=gen),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(256, 64, generator=gen),
    }
    save_file({**tensors, **mtp}, str(weights), metadata={"format": "pt"})
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "mg", tp=2, pp=2)
    assert (tmp_path / "mg/release/mp_rank_01_001/model_optim_rng.pt").exists()
    megatron_to_hf_checkpoint(tmp_path / "mg", tmp_path / "back", max_shard_bytes=8 << 20)
    back = {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(path))
    assert set(back) == set(tensors) | set(mtp)
    for name, tensor in {**tensors, **mtp}.items():
        assert torch.equal(back[name], tensor), name
    model = build_megatron_model(config, Parallelism()).eval()
    with SafetensorsReader(tmp_path / "back") as reader:
        load_hf_weights(model, reader)  # the MTP tensors are not the live model's
    got = model(**inputs["sbhd"])
    assert (got - expected)[inputs["valid"]].abs().max() < ATOL


def test_fla_backward_refusal_follows_fla_rule():
    """fla-core 0.6.0 raises mid-backward on Hopper with Triton 3.4.0-3.7.0 (met on the H200
    with torch 2.11's Triton); the check says so before the step, so `auto` takes torch."""
    from vlm_models.megatron.gated_delta_net import fla_backward_refusal, fla_refusal

    assert "Triton 3.6.0" in fla_backward_refusal(9, "3.6.0", tilelang=False)
    assert fla_backward_refusal(9, "3.6.0", tilelang=True) is None  # fla's tilelang backend
    assert fla_backward_refusal(9, "3.7.1", tilelang=False) is None
    assert fla_backward_refusal(9, "3.3.1", tilelang=False) is None
    assert fla_backward_refusal(8, "3.6.0", tilelang=False) is None  # Ampere is not affected
    assert fla_refusal(torch.device("cpu")) == "fla runs on CUDA only"


def test_per_expert_files_are_stacked_once_per_layer(tp1, make_hf_model, tmp_path, monkeypatch):
    """Qwen3.5-MoE folders hold one tensor per expert; the maps ask for a layer's two expert
    stacks once per local expert, in turn. Each stack is built once, not once per expert (at
    256 experts a 35B-A3B cut to 4 layers built 2,048 stacks of 256 and its trainer never
    finished starting), and the model loads the same weights."""
    from vlm_models.megatron import checkpoint

    config = qwen35_config("qwen3.5-moe-tiny")
    hf_model = make_hf_model(config, seed=3)
    hf_model.save_pretrained(tmp_path / "hf")
    builds = []
    stack = checkpoint.stack_experts
    monkeypatch.setattr(checkpoint, "stack_experts", lambda parts: builds.append(1) or stack(parts))
    model = build_megatron_model(config, Parallelism()).eval()
    with SafetensorsReader(tmp_path / "hf") as reader:
        assert reader.per_expert_layout()
        load_hf_weights(model, reader)
    moe_layers = config.text_config.num_hidden_layers
    assert len(builds) == 2 * moe_layers
    expected = _megatron(config, hf_model).state_dict()
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, expected[name]), name
