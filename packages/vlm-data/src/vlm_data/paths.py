"""Where a dataset's rows come from, decided without loading anything: a local file or folder
(and its files for a split) or a hub name. Standard library only, so that a launcher refuses a
dataset path that is not there before it prints or writes anything, and before `datasets`,
torch or transformers load; `vlm_data.loading` reads the files it finds."""

from __future__ import annotations

import os
import re
from pathlib import Path

from vlm_data.config import DataConfig

PARQUET = (".parquet",)
JSONL = (".jsonl", ".json", ".jsonl.gz", ".json.gz")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name


class DatasetLoadError(RuntimeError):
    """A dataset source that could not be found or read; the message says what to pass instead."""


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a path (``/x``, ``./x``, ``../x``, ``~/x``, or with a
    separator and not ``owner/name`` shaped): one that does not exist is then a missing path,
    never a hub name. (vlm_models' model names follow the same rule.)"""
    if name in (".", "..") or name.startswith(("/", "./", "../", "~")):
        return True
    separators = [s for s in (os.sep, os.altsep) if s]
    return any(s in name for s in separators) and not _HUB_ID.fullmatch(name)


def local_source(name: str | Path) -> Path | None:
    """The local file or folder ``name`` names; None for a hub name. A path that does not
    exist raises `DatasetLoadError` (never tried on the hub)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if looks_like_path(str(name)):
        raise DatasetLoadError(f"{name}: no such file or directory")
    return None


def split_files(path: Path, split: str) -> list[Path]:
    """The data files of ``split`` in a local file or folder: the file itself, or in the folder
    `{split}.parquet`, `{split}-*.parquet`, `data/{split}-*.parquet`, `{split}/*.parquet`,
    `{split}.jsonl` or `{split}.json`."""
    if path.is_file():
        if not path.name.endswith(PARQUET + JSONL):
            raise DatasetLoadError(f"{path}: expected a .parquet or .jsonl file")
        return [path]
    patterns = (
        f"{split}.parquet",
        f"{split}-*.parquet",
        f"data/{split}-*.parquet",
        f"{split}/*.parquet",
        f"{split}.jsonl",
        f"{split}.json",
    )
    for pattern in patterns:
        found = sorted(path.glob(pattern))
        if found:
            return found
    raise DatasetLoadError(
        f"no file for split {split!r} in {path} (looked for {', '.join(patterns)})"
    )


def check_dataset(data: DataConfig, split: str | None = None) -> None:
    """A local dataset exists and holds files for ``split`` (default: the training split),
    checked by their names only; a synthetic task or a hub name passes (the hub is asked when
    the rows load). Raises `DatasetLoadError`."""
    if data.synthetic_task is not None:
        return
    path = local_source(data.dataset)
    if path is not None:
        split_files(path, split or data.train_split)
