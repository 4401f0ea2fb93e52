import json
from pathlib import Path

import pytest
import transformers

from vlm_models.build import resolve_config
from vlm_models.presets import PRESETS, TINY_PRESETS, preset_config, tiny_config

TEXT_KEYS = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "rms_norm_eps",
]
VISION_KEYS = [
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "out_hidden_size",
    "num_position_embeddings",
    "deepstack_visual_indexes",
    "hidden_act",
]
TOKEN_KEYS = ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"]


def _real(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def real_configs(qwen3vl_dir: Path, shared_dir: Path) -> dict[str, dict]:
    ref = shared_dir / "models" / "reference-configs" / "qwen3-vl-8b-architecture.json"
    return {"qwen3-vl-4b": _real(qwen3vl_dir / "config.json"), "qwen3-vl-8b": _real(ref)}


@pytest.mark.parametrize("name", ["qwen3-vl-4b", "qwen3-vl-8b"])
def test_shape_presets_equal_real_config_files(name, real_configs):
    real, ours = real_configs[name], preset_config(name)
    for key in TEXT_KEYS:
        assert getattr(ours.text_config, key) == real["text_config"][key], key
    for key in VISION_KEYS:
        assert getattr(ours.vision_config, key) == real["vision_config"][key], key
    for key in TOKEN_KEYS:
        assert getattr(ours, key) == real[key], key
    assert ours.tie_word_embeddings == real["tie_word_embeddings"]
    rope = real["text_config"]["rope_scaling"]
    assert ours.text_config.rope_parameters["mrope_section"] == rope["mrope_section"]
    assert ours.text_config.rope_parameters["mrope_interleaved"] is True
    assert ours.text_config.rope_parameters["rope_theta"] == real["text_config"]["rope_theta"]


def test_2b_shares_the_4b_vision_tower(real_configs):
    two, real4 = preset_config("qwen3-vl-2b"), real_configs["qwen3-vl-4b"]["vision_config"]
    for key in VISION_KEYS:
        if key != "out_hidden_size":
            assert getattr(two.vision_config, key) == real4[key], key
    assert two.vision_config.out_hidden_size == two.text_config.hidden_size == 2048
    assert two.tie_word_embeddings


def _rotary_pairs(text) -> int:
    rope = text.rope_parameters
    return int(text.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_presets_keep_the_real_features(name, real_configs):
    real = real_configs["qwen3-vl-4b"]
    cfg = tiny_config(name)
    text, vision = cfg.text_config, cfg.vision_config
    # Interleaved M-RoPE over (t, h, w) covering every rotary pair.
    rope = text.rope_parameters
    assert rope["mrope_interleaved"] is True
    assert len(rope["mrope_section"]) == 3
    assert sum(rope["mrope_section"]) == _rotary_pairs(text)
    # GQA.
    assert text.num_key_value_heads < text.num_attention_heads
    assert text.num_attention_heads % text.num_key_value_heads == 0
    # Real patch geometry, so real processor outputs fit.
    for key in ["in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size"]:
        assert getattr(vision, key) == real["vision_config"][key], key
    assert vision.out_hidden_size == text.hidden_size
    if name.startswith("qwen3-vl"):
        for key in TOKEN_KEYS:
            assert getattr(cfg, key) == real[key], key
        # Deepstack: as many mergers as the real model, injected into distinct text layers.
        n_deep = len(real["vision_config"]["deepstack_visual_indexes"])
        assert len(vision.deepstack_visual_indexes) == n_deep
        assert max(vision.deepstack_visual_indexes) < vision.depth
        assert text.num_hidden_layers > n_deep
    if name == "qwen3-vl-tiny":
        assert cfg.tie_word_embeddings == real["tie_word_embeddings"] is True
    if name == "qwen3-vl-moe-tiny":
        assert cfg.tie_word_embeddings is False  # as 30B-A3B
        assert 1 < text.num_experts_per_tok < text.num_experts
    if name == "qwen3.5-tiny":
        kinds = set(text.layer_types)
        assert kinds == {"linear_attention", "full_attention"}


def test_qwen3_5_preset_follows_transformers():
    assert ("qwen3.5-tiny" in TINY_PRESETS) == hasattr(transformers, "Qwen3_5Config")


def test_overrides_reach_the_right_sub_config():
    cfg = tiny_config(vocab_size=1000, image_token_id=7, **{"vision_config.depth": 3})
    assert cfg.text_config.vocab_size == 1000
    assert cfg.image_token_id == 7
    assert cfg.vision_config.depth == 3
    assert tiny_config().text_config.vocab_size == 151936  # presets are not mutated
    with pytest.raises(ValueError, match="no_such_field"):
        tiny_config(no_such_field=1)
    with pytest.raises(ValueError, match="unknown tiny preset"):
        tiny_config("qwen3-vl-4b")
    assert set(TINY_PRESETS) <= set(PRESETS)


def test_a_config_only_folder_resolves_like_its_preset(qwen3vl_dir):
    from_folder = resolve_config(qwen3vl_dir, num_hidden_layers=2)
    preset = preset_config("qwen3-vl-4b")
    assert from_folder.text_config.num_hidden_layers == 2
    for key in TEXT_KEYS[2:]:
        assert getattr(from_folder.text_config, key) == getattr(preset.text_config, key), key
    for key in VISION_KEYS:
        assert getattr(from_folder.vision_config, key) == getattr(preset.vision_config, key), key


@pytest.mark.parametrize("layers", [4, 8])
def test_a_cut_qwen35_keeps_its_layer_pattern_and_loads(tmp_path, layers):
    """The recipe shapes cut to a few layers for a GPU benchmark: Qwen3.5 keeps three
    linear-attention layers then a full one, and the saved config loads again (transformers
    refuses layer_types of another length)."""
    from transformers import AutoConfig

    config = preset_config("qwen3.5-35b-a3b", num_hidden_layers=layers)
    config.save_pretrained(tmp_path)
    text = AutoConfig.from_pretrained(tmp_path).text_config
    assert text.num_hidden_layers == layers
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    assert text.layer_types == pattern * (layers // 4)
