"""Checkpoint resume, HF export and weight buckets."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3VLForConditionalGeneration

from trainers_fsdp import OptimConfig
from trainers_fsdp.actor import FsdpActor


class RunsCode:
    """What a hostile checkpoint file holds: unpickling it runs code (here: creates a file)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"param_dtype": "bfloat16"},
        {"param_dtype": "bfloat16", "flat_update": True},
        {"shard_single_rank": True},
    ],
    ids=["float32", "bf16-masters", "bf16-masters-flat", "fsdp"],
)
def test_resume_reproduces_next_step_exactly(make_config, batch, tmp_path, mode):
    optim = OptimConfig(lr=1e-2, lr_schedule="cosine", warmup_steps=1, total_steps=5)
    actor = FsdpActor(make_config(optim=optim, **mode))
    actor.train_step(batch, loss="grpo")
    actor.save_checkpoint(tmp_path / "ckpt")
    expected = actor.train_step(batch, loss="grpo")

    resumed = FsdpActor(make_config(optim=optim, seed=123, **mode))  # other init, overwritten
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    got = resumed.train_step(batch, loss="grpo")
    for key in ("loss", "grad_norm", "lr", "clip_frac", "entropy"):
        assert got[key] == expected[key], key
    ours = resumed.full_parameters()
    for name, p in actor.full_parameters().items():
        assert torch.equal(p, ours[name]), name


@pytest.mark.parametrize("tampered", [".metadata", "trainer_state_rank0.pt"])
def test_loading_a_tampered_checkpoint_runs_no_code(make_config, tmp_path, tampered):
    """DCP's metadata pickle and the trainer state are read by loaders that build only
    checkpoint data; torch's own DCP reader would run the payload."""
    actor = FsdpActor(make_config())
    actor.save_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "code_ran"
    target = tmp_path / "ckpt" / tampered
    if tampered == ".metadata":
        target.write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        torch.save({"step": 1, "scheduler": RunsCode(marker)}, target)
    with pytest.raises(pickle.UnpicklingError):
        actor.load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


def test_export_hf_loads_with_from_pretrained(make_config, batch, tmp_path):
    actor = FsdpActor(make_config(logprobs_scope="all"))
    actor.train_step(batch, loss="sft")  # weights now differ from the seed's init
    actor.export_hf(tmp_path / "hf", dtype="float32")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        tmp_path / "hf", attn_implementation="sdpa"
    ).eval()
    ours = actor.compute_logprobs(batch)
    ids = batch.input_ids[0]
    with torch.no_grad():
        logits = model(
            input_ids=ids[None],
            pixel_values=batch.pixel_values[0],
            image_grid_thw=batch.image_grid_thw[0],
            mm_token_type_ids=(ids == model.config.image_token_id).int()[None],
        ).logits[0]
    ref = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).squeeze(1)
    torch.testing.assert_close(ours[0][1:], ref, atol=2e-5, rtol=1e-5)


def test_export_hf_files_honour_the_umask(make_config, tmp_path):
    """Every exported file gets the mode `open()` gives a new file: the weights were 0600
    (safetensors' temporary file) beside a 0644 config.json."""
    actor = FsdpActor(make_config())
    saved = os.umask(0o027)
    try:
        actor.export_hf(tmp_path / "hf", dtype="float32")
    finally:
        os.umask(saved)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert any(name.startswith("model-") for name in modes), modes
    assert set(modes.values()) == {oct(0o666 & ~0o027)}, modes


def test_iter_hf_weights_are_full_checkpoint_named_tensors(make_config, make_plain_model, tmp_path):
    actor = FsdpActor(make_config(export_dtype="float32"))
    bucket_bytes = 64 * 1024
    buckets = list(actor.iter_hf_weights(bucket_bytes))
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1
    ours = {name: t for bucket in buckets for name, t in bucket}
    # the names and shapes an HF checkpoint of the same model holds (tied lm_head left out)
    plain = make_plain_model()
    plain.save_pretrained(tmp_path / "ref")
    index = tmp_path / "ref" / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        with safe_open(tmp_path / "ref" / "model.safetensors", "pt") as f:
            names = set(f.keys())
    assert set(ours) == names
    assert "lm_head.weight" not in ours
    sd = plain.state_dict()
    for name, t in ours.items():
        assert t.shape == sd[name].shape and t.device.type == "cpu", name
        torch.testing.assert_close(t, sd[name])  # same seed: same init, gathered in full
    assert ours["model.visual.patch_embed.proj.weight"].dim() == 5  # Conv3d layout kept


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_export_dtype(make_config, dtype):
    actor = FsdpActor(make_config(export_dtype=dtype))
    name, t = next(iter(actor.iter_hf_weights(1 << 20)))[0]
    assert t.dtype == getattr(torch, dtype), name
