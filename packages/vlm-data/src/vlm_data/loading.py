"""Load image+question datasets from the hub, a local parquet file or folder, or JSONL.

Rows come back with canonical column names (`problem`, `answer`, `images`) whatever the source
calls them, and with images left undecoded (`{"bytes", "path"}` dicts, strings, ...) so that a
corrupt image fails one row in `PromptBuilder`, not the whole iteration. Likewise a JSONL line
that is not a JSON object is skipped, named (file and line) and counted, instead of failing the
whole file.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlm_data.images import is_relative_file_path
from vlm_data.paths import JSONL, DatasetLoadError, local_source, split_files

if TYPE_CHECKING:  # datasets is imported where used: the prompt path runs without it
    import datasets

logger = logging.getLogger(__name__)

PROMPT_KEY = "problem"
ANSWER_KEY = "answer"
IMAGE_KEY = "images"


def load_rows(
    source: str | Path,
    *,
    split: str = "train",
    prompt_key: str = PROMPT_KEY,
    answer_key: str = ANSWER_KEY,
    image_key: str = IMAGE_KEY,
    stats: Counter[str] | None = None,
) -> datasets.Dataset:
    """Load one split as a `datasets.Dataset` with columns `problem`, `answer`, `images`.

    source: a local `.parquet`/`.jsonl` file; a folder holding `{split}.parquet`,
    `{split}-*.parquet`, `data/{split}-*.parquet` or `{split}.jsonl`; or a hub dataset name
    (`hiyouga/geometry3k`). Relative image file paths in rows resolve inside the file's folder.
    Malformed JSONL lines are skipped with a warning naming file and line, and counted in
    `stats["malformed_line"]` (pass a builder's `stats` to report them with its other skips).
    """
    import datasets

    path = local_source(source)  # a path that is not there raises: never tried on the hub
    if path is not None:
        files = split_files(path, split)
        base_dir = files[0].parent
        if files[0].name.endswith(JSONL):
            dataset, skipped = _load_jsonl(files)
            if stats is not None and skipped:
                stats["malformed_line"] += skipped
        else:
            dataset = datasets.load_dataset(
                "parquet", data_files=[str(f) for f in files], split="train"
            )
        logger.info("loaded %d rows of %s from %s", len(dataset), split, path)
    else:
        base_dir = None
        dataset = _load_hub(str(source), split)
    dataset = _canonical_columns(dataset, prompt_key, answer_key, image_key, source)
    dataset = _undecoded_images(dataset)
    if base_dir is not None:
        dataset = _absolute_image_paths(dataset, base_dir)
    return dataset


MAX_LINE_WARNINGS = 10
"""Malformed lines named one by one per file; the rest are only counted."""


def _open_text(path: Path):
    return gzip.open(path, "rt") if path.name.endswith(".gz") else open(path)


def _malformed_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, reason) of each non-empty line that is not a JSON object. A `.json` file
    that is one JSON document (an array of rows) has none: it is not line-delimited."""
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        try:
            with _open_text(path) as f:
                json.load(f)
            return []
        except ValueError:
            pass  # not one document: read it line by line
    bad = []
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.strip())
            except ValueError as err:
                bad.append((number, f"not JSON ({err})"))
                continue
            if not isinstance(row, dict):
                bad.append((number, f"a JSON {type(row).__name__}, not an object"))
    return bad


def _load_jsonl(files: list[Path]) -> tuple[datasets.Dataset, int]:
    """Load JSONL files; files with malformed lines are loaded from a copy without them."""
    import datasets

    workdir = None
    clean: list[str] = []
    skipped = 0
    try:
        for path in files:
            bad = _malformed_lines(path)
            if not bad:
                clean.append(str(path))
                continue
            for number, reason in bad[:MAX_LINE_WARNINGS]:
                logger.warning("%s:%d: skipping a malformed line: %s", path, number, reason)
            logger.warning("%s: skipped %d malformed line(s)", path, len(bad))
            skipped += len(bad)
            workdir = workdir or Path(tempfile.mkdtemp(prefix="vlm_data_jsonl_"))
            copy = workdir / f"{len(clean)}.jsonl"
            drop = {number for number, _ in bad}
            with _open_text(path) as src, open(copy, "w") as dst:
                for number, line in enumerate(src, 1):
                    if number not in drop and line.strip():
                        dst.write(line if line.endswith("\n") else line + "\n")
            clean.append(str(copy))
        if workdir is None:
            return datasets.load_dataset("json", data_files=clean, split="train"), 0
        # The copies live only as long as this call: load them into memory, cache apart.
        dataset = datasets.load_dataset(
            "json",
            data_files=clean,
            split="train",
            keep_in_memory=True,
            cache_dir=str(workdir / "cache"),
        )
        return dataset, skipped
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _load_hub(name: str, split: str) -> datasets.Dataset:
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as exc:  # offline, unknown name, missing split: all end the same way
        raise DatasetLoadError(
            f"could not load dataset {name!r} (split {split!r}) from the Hugging Face hub: "
            f"{exc.__class__.__name__}: {exc}. Without network, "
            "pass a local parquet/JSONL file or folder (e.g. ../shared/data/geo3k)."
        ) from exc


def _canonical_columns(
    dataset: datasets.Dataset, prompt_key: str, answer_key: str, image_key: str, source: Any
) -> datasets.Dataset:
    renames = {prompt_key: PROMPT_KEY, answer_key: ANSWER_KEY, image_key: IMAGE_KEY}
    missing = [key for key in (prompt_key, answer_key) if key not in dataset.column_names]
    if missing:
        raise DatasetLoadError(
            f"{source}: missing column(s) {missing}; columns are {dataset.column_names} "
            "(set prompt_key/answer_key/image_key)"
        )
    renames = {k: v for k, v in renames.items() if k != v and k in dataset.column_names}
    for new in renames.values():
        if new in dataset.column_names and new not in renames:
            dataset = dataset.remove_columns(new)  # the canonical name is taken by another column
    return dataset.rename_columns(renames) if renames else dataset


def _undecoded_images(dataset: datasets.Dataset) -> datasets.Dataset:
    import datasets

    feature = dataset.features.get(IMAGE_KEY)
    inner = getattr(feature, "feature", feature)
    if isinstance(inner, datasets.Image) and inner.decode:
        new = datasets.Image(decode=False)
        dataset = dataset.cast_column(IMAGE_KEY, new if feature is inner else datasets.List(new))
    return dataset


def _absolute_image_paths(dataset: datasets.Dataset, base_dir: Path) -> datasets.Dataset:
    """Make relative image file paths absolute (inside the dataset's folder) where rows have any."""
    if IMAGE_KEY not in dataset.column_names:
        return dataset
    import datasets

    feature = dataset.features[IMAGE_KEY]
    inner = getattr(feature, "feature", feature)
    if not (isinstance(inner, datasets.Value) and inner.dtype in ("string", "large_string")):
        return dataset  # bytes dicts resolve their own paths through ImageLoader(base_dir)

    def fix(value: Any) -> Any:
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and is_relative_file_path(value):
            return str(base_dir / value)
        return value

    return dataset.map(lambda row: {IMAGE_KEY: fix(row[IMAGE_KEY])}, desc="resolving image paths")
