"""Model names to loadable sources: presets, folders, run folders, hub ids (never a silent
random model). No test downloads anything: the hub is either unreachable here or switched off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vlm_models import ModelSourceError
from vlm_models.hub import resolve_model_source
from vlm_models.presets import tiny_config


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    tiny_config().save_pretrained(folder)
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    return folder


def test_preset_names_stay_names():
    assert resolve_model_source("qwen3-vl-8b") == "qwen3-vl-8b"
    assert resolve_model_source("qwen3-vl-tiny", require_weights=True) == "qwen3-vl-tiny"


def test_local_folder_and_run_folder(hf_folder: Path, tmp_path: Path):
    assert resolve_model_source(str(hf_folder), require_weights=True) == str(hf_folder)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    hf_folder.rename(run / "hf")
    assert resolve_model_source(str(run)) == str(run / "hf")


def test_folder_without_weights_is_refused_when_weights_are_required(tmp_path: Path):
    tiny_config().save_pretrained(tmp_path)
    assert resolve_model_source(str(tmp_path)) == str(tmp_path)  # a config to build from
    with pytest.raises(ModelSourceError, match=r"no weights.*preset"):
        resolve_model_source(str(tmp_path), require_weights=True)


def test_missing_folder_and_folder_without_config(tmp_path: Path):
    with pytest.raises(ModelSourceError, match="no such folder"):
        resolve_model_source(str(tmp_path / "nope"))
    with pytest.raises(ModelSourceError, match=r"no config\.json"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ModelSourceError, match="not a preset"):
        resolve_model_source("Qwen3-VL-8B-Instruct")  # bare name, no namespace given


def test_hub_id_without_network_fails_fast_naming_it():
    """This machine has no route to the hub; where one exists the id is unknown there."""
    start = time.monotonic()
    with pytest.raises(ModelSourceError) as err:
        resolve_model_source("glimpse-tests/no-such-model-xyz", timeout=5)
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "glimpse-tests/no-such-model-xyz" in message and "local folder" in message
    assert "\n" not in message


def test_offline_mode_reads_the_cache(tmp_path: Path, monkeypatch):
    """Offline (HF_HUB_OFFLINE, read by huggingface_hub at import, set here on its constants):
    a cached snapshot is found, a missing one is a one-line error naming the id."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--Qwen--Qwen3-VL-8B-Instruct"
    snapshot = repo / "snapshots" / "abc123"
    tiny_config().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    found = resolve_model_source("Qwen3-VL-8B-Instruct", hub_namespace="Qwen")
    assert Path(found) == snapshot.resolve()
    with pytest.raises(ModelSourceError, match=r"'Qwen/Qwen3-VL-2B-Instruct': HF_HUB_OFFLINE"):
        resolve_model_source("Qwen3-VL-2B-Instruct", hub_namespace="Qwen")
