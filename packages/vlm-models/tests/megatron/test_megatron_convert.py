"""HF <-> Megatron weight conversion: exact round trips, in memory and through folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlm_models.megatron import (
    Parallelism,
    SafetensorsReader,
    build_megatron_model,
    fuse_qkv,
    hf_state_dict_to_megatron,
    hf_to_megatron_checkpoint,
    initialize_model_parallel,
    iter_hf_weights,
    load_hf_weights,
    load_megatron_checkpoint,
    megatron_shards_to_hf,
    megatron_to_hf_checkpoint,
    split_qkv,
    stage_layouts,
    text_arch,
    transformer_config,
)
from vlm_models.presets import tiny_config
from weight_sync import iter_weight_buckets
from weight_sync.files import umask_mode

REPO = Path(__file__).resolve().parents[4]


def _hf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: tied ``lm_head.weight`` left out, as save_pretrained does."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize(
    ("preset", "tie", "tp", "pp", "use_te"),
    [
        ("qwen3-vl-tiny", True, 1, 1, False),
        ("qwen3-vl-tiny", True, 2, 2, False),
        ("qwen3-vl-tiny", False, 2, 2, False),
        ("qwen3-vl-tiny", False, 4, 4, True),
        ("qwen3-vl-moe-tiny", False, 2, 2, False),
    ],
)
def test_in_memory_round_trip_is_bit_exact(make_hf_model, preset, tie, tp, pp, use_te):
    config = tiny_config(preset, tie_word_embeddings=tie)
    hf = _hf_tensors(make_hf_model(config, seed=2))
    arch = text_arch(config)
    shards = hf_state_dict_to_megatron(hf, arch, tp_size=tp, pp_size=pp, use_te=use_te)
    assert len(shards) == tp * pp
    back = megatron_shards_to_hf(shards, arch, use_te=use_te)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    if pp > 1:  # tied or not, the last stage has an output layer and the first an embedding
        assert "language_model.output_layer.weight" in shards[(0, pp - 1)]
        assert "language_model.embedding.word_embeddings.weight" in shards[(0, 0)]


def test_qkv_fusion_groups_heads_per_kv_group():
    """Megatron's layout: for each KV group, its query heads, then its key, then its value."""
    arch = text_arch(tiny_config())  # 4 query heads, 2 KV groups, head_dim 32
    hd = arch.head_dim
    q = torch.arange(arch.num_heads * hd, dtype=torch.float32)[:, None].expand(-1, 3)
    k = 1000 + torch.arange(arch.num_kv_heads * hd, dtype=torch.float32)[:, None].expand(-1, 3)
    v = 2000 + torch.arange(arch.num_kv_heads * hd, dtype=torch.float32)[:, None].expand(-1, 3)
    fused = fuse_qkv(q, k, v, arch)
    group0 = fused[: 4 * hd, 0]  # q heads 0-1, k head 0, v head 0
    assert torch.equal(group0[: 2 * hd], q[: 2 * hd, 0])
    assert torch.equal(group0[2 * hd : 3 * hd], k[:hd, 0])
    assert torch.equal(group0[3 * hd :], v[:hd, 0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, arch), (q, k, v), strict=True))


def test_bad_splits_are_clear_errors():
    config = tiny_config(vocab_size=151937)
    with pytest.raises(ValueError, match="vocab_size 151937"):
        transformer_config(config, Parallelism(tp=2))
    with pytest.raises(ValueError, match="cannot split 4 layers over 3 stages"):
        stage_layouts(4, 3)
    assert [s.num_layers for s in stage_layouts(4, 2, first_stage_layers=3)] == [3, 1]


def test_checkpoint_folders_round_trip_and_load(
    make_hf_model, tiny_setup, to_megatron_inputs, tmp_path
):
    config, _, batch = tiny_setup
    hf_model = make_hf_model(config, seed=4)
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "mg", tp=2, pp=2)
    assert (tmp_path / "mg/release/mp_rank_01_001/model_optim_rng.pt").exists()
    megatron_to_hf_checkpoint(tmp_path / "mg", tmp_path / "back", max_shard_bytes=8 << 20)
    index = json.loads((tmp_path / "back/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded output
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "back").iterdir()}
    assert set(modes.values()) == {umask_mode()}, modes  # the shards too (safetensors: 0600)
    back = {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(path))
    original = _hf_tensors(hf_model)
    assert set(back) == set(original)
    assert all(torch.equal(back[n], t) for n, t in original.items())

    # A TP=1 folder loads into the live model and gives the HF model's logits.
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "mg1")
    initialize_model_parallel(Parallelism())
    model = build_megatron_model(config, Parallelism()).eval()
    load_megatron_checkpoint(model, tmp_path / "mg1")
    inputs = to_megatron_inputs(config, batch)
    with torch.no_grad():
        got = model(**inputs["sbhd"])
        expected = hf_model(**batch).logits
    assert (got - expected)[inputs["valid"]].abs().max() < 1e-5
    reference = build_megatron_model(config, Parallelism())
    load_hf_weights(reference, hf_model.state_dict())
    assert all(
        torch.equal(a, b)
        for (_, a), (_, b) in zip(
            sorted(model.state_dict().items()), sorted(reference.state_dict().items()), strict=True
        )
        if a is not None and isinstance(a, torch.Tensor)
    )
    with pytest.raises(ValueError, match="tp=2 pp=2 shards"):
        load_megatron_checkpoint(model, tmp_path / "mg")


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


def test_moe_checkpoint_folders_round_trip(make_hf_model, tiny_setup, to_megatron_inputs, tmp_path):
    """Released MoE files store experts transposed, transformers 5 writes them untransposed:
    both folders convert back bit for bit, and both load into the live model correctly."""
    _, _, batch = tiny_setup
    config = tiny_config("qwen3-vl-moe-tiny", moe_intermediate_size=16)  # non-square experts
    hf_model = make_hf_model(config, seed=8)
    hf_model.save_pretrained(tmp_path / "memory")
    memory = _read_folder(tmp_path / "memory")
    stack = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert memory[stack].shape == (8, 32, 64)  # [E, 2I, H]
    released = {
        n: t.transpose(1, 2).contiguous() if n.endswith(("gate_up_proj", "down_proj")) else t
        for n, t in memory.items()
    }
    (tmp_path / "released").mkdir()
    save_file(released, tmp_path / "released/model.safetensors", metadata={"format": "pt"})
    (tmp_path / "released/config.json").write_text((tmp_path / "memory/config.json").read_text())

    initialize_model_parallel(Parallelism())
    inputs = to_megatron_inputs(config, batch)
    with torch.no_grad():
        expected = hf_model(**batch).logits
    for layout, files in (("memory", memory), ("released", released)):
        hf_to_megatron_checkpoint(tmp_path / layout, tmp_path / f"mg_{layout}", tp=2, pp=2)
        megatron_to_hf_checkpoint(tmp_path / f"mg_{layout}", tmp_path / f"back_{layout}")
        back = _read_folder(tmp_path / f"back_{layout}")
        assert set(back) == set(files)
        assert all(torch.equal(back[n], t) for n, t in files.items()), layout

        model = build_megatron_model(config, Parallelism()).eval()
        with SafetensorsReader(tmp_path / layout) as reader:
            load_hf_weights(model, reader)
        with torch.no_grad():
            got = model(**inputs["sbhd"])
        assert (got - expected)[inputs["valid"]].abs().max() < 1e-5, layout

    exported = {}
    for bucket in iter_hf_weights(model, file_layout=True):
        exported.update(bucket)
    assert all(torch.equal(exported[n], t) for n, t in released.items())
    # one bucketer for every trainer: Megatron's buckets are weight_sync.iter_weight_buckets
    budget = 64 << 10
    buckets = [[n for n, _ in b] for b in iter_hf_weights(model, bucket_bytes=budget)]
    stream = ((n, exported[n]) for b in buckets for n in b)
    assert buckets == [[n for n, _ in b] for b in iter_weight_buckets(stream, budget)]
    assert len(buckets) > 1


@pytest.mark.slow
def test_conversion_tools(make_hf_model, tmp_path):
    config = tiny_config(tie_word_embeddings=False)
    hf_model = make_hf_model(config, seed=5)
    hf_model.save_pretrained(tmp_path / "hf")
    run = [
        sys.executable,
        str(REPO / "tools/convert_hf_to_megatron.py"),
        "--hf",
        str(tmp_path / "hf"),
    ]
    subprocess.run([*run, "--out", str(tmp_path / "mg"), "--tp", "2", "--pp", "2"], check=True)
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/convert_megatron_to_hf.py"),
            "--megatron",
            str(tmp_path / "mg"),
            "--out",
            str(tmp_path / "back"),
        ],
        check=True,
    )
    back = {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(path))
    original = _hf_tensors(hf_model)
    assert set(back) == set(original) and "lm_head.weight" in back
    assert all(torch.equal(back[n], t) for n, t in original.items())
