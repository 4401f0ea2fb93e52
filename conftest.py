"""Test settings shared by every package: where the real data and model files live.

The real Geometry3K parquet files and the Qwen3-VL tokenizer/processor files are read from one
place, `GLIMPSE_SHARED` (default: `../shared` beside the checkout). They are never copied into
the repository.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

# One thread per process: the suite runs two test files at a time (``-n 2`` in the README's
# command) on a 2-core machine, and its tiny models gain nothing from a second thread (the
# FSDP package alone: 281 s with two threads per process, one file at a time; 181 s with one
# thread, two at a time). Set before torch starts its thread pool; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent


def shared_root() -> Path:
    return Path(os.environ.get("GLIMPSE_SHARED", ROOT.parent / "shared")).resolve()


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found: set GLIMPSE_SHARED to the folder holding data/ and models/")
    return path


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared folder (data/geo3k, models/Qwen3-VL-4B-Instruct, models/reference-configs)."""
    return _require(shared_root())


@pytest.fixture(scope="session")
def geo3k_dir(shared_dir: Path) -> Path:
    """Folder with the real Geometry3K `train.parquet` and `validation.parquet`."""
    return _require(shared_dir / "data" / "geo3k")


@pytest.fixture(scope="session")
def qwen3vl_dir(shared_dir: Path) -> Path:
    """Real Qwen3-VL-4B-Instruct tokenizer, processor and config files (no weights)."""
    return _require(shared_dir / "models" / "Qwen3-VL-4B-Instruct")


#: The longest files (real launcher processes, Ray clusters), run first: with two workers each
#: taking whole files, a long one taken last would run alone at the end (clean-clone suite,
#: two at a time, 2026-12-07: the end-to-end file 780 s of 1,135, the Ray cluster's 205,
#: the faults' 263).
LONGEST_FIRST = (
    "tests/test_e2e_geo3k.py",
    "tests/test_faults.py",
    "tests/test_ray_cluster.py",
    "tests/test_ray_groups.py",
)


def _file_order(item: pytest.Item) -> int:
    try:
        return LONGEST_FIRST.index(item.path.relative_to(ROOT).as_posix())
    except ValueError:
        return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FIRST``; otherwise collection's order); skip tests
    marked `gpu` where no CUDA device is present."""
    items.sort(key=_file_order)  # stable: each file's tests keep their order
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made (torch, transformers, megatron-core, Ray, the test modules:
    millions of objects that live for the whole session) out of the garbage collector's walk.
    Building an actor collects garbage at each start-up phase (``trainer_core.startup``), and
    each collection walked the whole heap: about half a second each, hundreds of times a
    suite. Objects the tests make are collected as before."""
    gc.collect()
    gc.freeze()
