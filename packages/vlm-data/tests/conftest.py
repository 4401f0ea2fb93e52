"""Fixtures of the vlm-data tests: the real Qwen3-VL processor and geo3k rows (session-wide)."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from vlm_data.loading import load_rows
from vlm_data.processor import build_processor, tiny_processor


@pytest.fixture(scope="session")
def real_processor(qwen3vl_dir: Path):
    return build_processor(qwen3vl_dir)


@pytest.fixture(scope="session")
def tiny():
    return tiny_processor()


@pytest.fixture(scope="session")
def geo3k_validation(geo3k_dir: Path) -> datasets.Dataset:
    return load_rows(geo3k_dir, split="validation")
