import importlib.util
import logging

import pytest
import torch

from vlm_models import ModelSourceError
from vlm_models.build import (
    build_model,
    set_vision_trainable,
    stored_float_dtypes,
    vision_tower,
)
from vlm_models.flops import count_parameters
from vlm_models.presets import TINY_PRESETS, tiny_config


def _labels(sample) -> torch.Tensor:
    return sample["input_ids"].masked_fill(sample["mm_token_type_ids"].bool(), -100)


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_forward_backward_on_real_processor_outputs(name, samples, qwen3_vl_ids):
    torch.manual_seed(0)
    model = build_model(name, **(qwen3_vl_ids if name.startswith("qwen3.5") else {}))
    sample = samples[2]  # two real geo3k images
    out = model(**sample, labels=_labels(sample))
    assert out.logits.shape == (*sample["input_ids"].shape, model.config.text_config.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    visual = vision_tower(model)
    assert visual.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
    if getattr(model.config.vision_config, "deepstack_visual_indexes", None):
        assert visual.deepstack_merger_list[0].linear_fc2.weight.grad.abs().sum() > 0


def test_attention_is_selected_per_tower_and_implementations_agree(samples):
    torch.manual_seed(0)
    model = build_model("qwen3-vl-tiny", vision_attn_implementation="eager").eval()
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == "eager"
    assert vision_tower(model).config._attn_implementation == "eager"
    torch.manual_seed(0)
    eager = build_model("qwen3-vl-tiny", attn_implementation="eager").eval()
    assert eager.config.text_config._attn_implementation == "eager"
    with torch.no_grad():
        a, b = model(**samples[0]).logits, eager(**samples[0]).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn present")
def test_missing_flash_attn_says_how_to_install():
    with pytest.raises(ImportError, match="uv sync --extra gpu"):
        build_model("qwen3-vl-tiny", attn_implementation="flash_attention_2")
    with pytest.raises(ImportError, match="flash"):
        build_model("qwen3-vl-tiny", vision_attn_implementation="flash_attention_3")


def test_freeze_vision_leaves_only_the_language_model_trainable(samples):
    model = build_model("qwen3-vl-tiny", freeze_vision=True)
    counts = count_parameters(model)
    assert counts["trainable"] == counts["language"] == counts["total"] - counts["vision"]
    sample = samples[0]
    model(**sample, labels=_labels(sample)).loss.backward()
    assert all(p.grad is None for p in vision_tower(model).parameters())
    assert model.get_input_embeddings().weight.grad is not None
    set_vision_trainable(model, True)
    assert count_parameters(model)["trainable"] == counts["total"]


def test_gradient_checkpointing_gives_the_same_gradients(samples):
    sample = samples[0]
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model("qwen3-vl-tiny", gradient_checkpointing=checkpointing).train()
        assert model.is_gradient_checkpointing == checkpointing
        model(**sample, labels=_labels(sample)).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_folder_without_weights_builds_random_init(tmp_path, caplog):
    tiny_config(num_hidden_layers=5).save_pretrained(tmp_path)  # config.json only
    with caplog.at_level(logging.WARNING, logger="vlm_models.build"):
        model = build_model(tmp_path, dtype=torch.bfloat16, intermediate_size=96)
    assert "holds no weights" in caplog.text
    assert model.config.text_config.num_hidden_layers == 5
    assert model.config.text_config.intermediate_size == 96
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16


def test_config_object_source_is_not_mutated():
    cfg = tiny_config()
    model = build_model(cfg, num_hidden_layers=2)
    assert model.config.text_config.num_hidden_layers == 2
    assert cfg.text_config.num_hidden_layers == 4


def test_missing_folder_is_an_error_before_any_download(tmp_path):
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        build_model(str(tmp_path / "missing" / "model"))


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_a_checkpoint_loads_narrow_only_where_nothing_is_rounded(name, tmp_path):
    """``narrow_dtype``: a bf16 checkpoint loads in bf16 with the values and buffers the float32
    load has (bf16 widens exactly); one tensor stored wider keeps the whole load wide."""
    build_model(name, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert stored_float_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    wide = build_model(tmp_path / "bf16")
    narrow = build_model(tmp_path / "bf16", narrow_dtype=torch.bfloat16)
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    wide_params = dict(wide.named_parameters())
    for key, param in narrow.named_parameters():
        assert torch.equal(param.float(), wide_params[key]), key
    wide_buffers = dict(wide.named_buffers())
    for key, buffer in narrow.named_buffers():  # rotary frequencies stay float32
        assert buffer.dtype == wide_buffers[key].dtype and torch.equal(buffer, wide_buffers[key])

    mixed = build_model(name, dtype=torch.bfloat16)
    mixed.get_input_embeddings().float()
    mixed.save_pretrained(tmp_path / "mixed")
    assert stored_float_dtypes(tmp_path / "mixed") == {torch.bfloat16, torch.float32}
    loaded = build_model(tmp_path / "mixed", narrow_dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


def test_stored_dtypes_are_unknown_without_safetensors(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert stored_float_dtypes(tmp_path) is None
