"""The workspace itself: every package imports, and shared files are where the setting says."""

import importlib

import pytest

PACKAGES = [
    "rewards_math",
    "rl_algos",
    "vlm_data",
    "vlm_models",
    "rollout_sglang",
    "trainers_fsdp",
    "trainers_megatron",
    "rl_runtime",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports(name: str) -> None:
    assert importlib.import_module(name).__name__ == name


def test_shared_files_present(geo3k_dir, qwen3vl_dir) -> None:
    assert (geo3k_dir / "validation.parquet").is_file()
    assert (qwen3vl_dir / "vocab.json").is_file()
