"""Model names to loadable sources: presets, folders, run folders, hub ids (never a silent
random model). No test downloads anything: the hub is either unreachable here or switched off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vlm_models import ModelConfig, ModelSourceError
from vlm_models.config import PRESET_NAMES
from vlm_models.hub import check_model, looks_like_path, resolve_model_source
from vlm_models.presets import PRESETS, tiny_config


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
    with pytest.raises(ModelSourceError, match="nope: no such file or directory"):
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


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("/data/x", True),
        ("./x", True),
        ("../x", True),
        ("~/x", True),
        ("runs/sft/hf", True),
        ("Qwen/Qwen3-VL-8B-Instruct", False),
        ("Qwen3-VL-8B-Instruct", False),
        ("qwen3-vl-tiny", False),
    ],
)
def test_a_name_is_a_path_by_its_look(name: str, path: bool):
    assert looks_like_path(name) is path


def test_check_model_asks_without_downloading(hf_folder: Path, tmp_path: Path, monkeypatch):
    """The launcher's check before anything is printed or written: presets and folders pass,
    a path that is not there is named as a path, a hub id offline must be in the cache."""
    from huggingface_hub import constants

    assert set(PRESETS) <= set(PRESET_NAMES)  # known without importing transformers
    check_model(ModelConfig(model_name="qwen3-vl-8b", tokenizer="tiny"))
    check_model(ModelConfig(model_name=str(hf_folder)))
    check_model(ModelConfig(model_name="/nope"), load=str(hf_folder))  # --load stands for it
    with pytest.raises(ModelSourceError, match=r"^--model-name: /data/x: no such file or dir"):
        check_model(ModelConfig(model_name="/data/x"))
    with pytest.raises(ModelSourceError, match=r"^--load: /data/run: no such file or directory"):
        check_model(ModelConfig(), load="/data/run")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelSourceError, match=r"^--tokenizer: model 'Qwen/Qwen3-VL-4B-Inst"):
        check_model(ModelConfig(model_name=str(hf_folder), tokenizer="Qwen3-VL-4B-Instruct"))
    assert not list(tmp_path.glob("models--*"))  # nothing downloaded
