from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import pytest
from PIL import Image

from vlm_data import DataConfig
from vlm_data.images import ImageLoader
from vlm_data.loading import DatasetLoadError, load_rows
from vlm_data.paths import check_dataset, looks_like_path


def test_geo3k_folder_parquet_file_and_canonical_columns(geo3k_dir):
    rows = load_rows(geo3k_dir, split="validation")
    assert len(rows) == 300
    assert {"problem", "answer", "images"} <= set(rows.column_names)
    first = rows[0]
    assert first["problem"].startswith("<image>")
    assert isinstance(first["images"][0], dict) and first["images"][0]["bytes"][:4] == b"\x89PNG"
    same = load_rows(geo3k_dir / "validation.parquet")
    assert same["problem"] == rows["problem"]


def test_jsonl_with_custom_keys_and_relative_image_paths(tmp_path: Path):
    data = tmp_path / "set"
    (data / "pics").mkdir(parents=True)
    Image.new("RGB", (5, 5), (9, 9, 9)).save(data / "pics" / "p0.png")
    lines = [
        {"question": "<image>What?", "label": "7", "pictures": ["pics/p0.png"]},
        {"question": "No image here", "label": "1", "pictures": []},
    ]
    (data / "test.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    rows = load_rows(
        data, split="test", prompt_key="question", answer_key="label", image_key="pictures"
    )
    assert rows.column_names == ["problem", "answer", "images"]
    path = rows[0]["images"][0]
    assert Path(path).is_absolute() and Path(path).parent == data / "pics"
    assert ImageLoader().load(path).getpixel((0, 0)) == (9, 9, 9)
    # Run from anywhere: the path does not depend on the working directory.
    assert rows[1]["images"] == []


def test_malformed_jsonl_lines_are_skipped_named_and_counted(tmp_path: Path, caplog, monkeypatch):
    """A torn line, a bare number and a list among good rows: the good rows load (relative image
    paths still resolve), each bad line is named by file and line, and counted."""
    import tempfile
    from collections import Counter

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the cleaned copy goes
    data = tmp_path / "set"
    (data / "pics").mkdir(parents=True)
    Image.new("RGB", (5, 5), (9, 9, 9)).save(data / "pics" / "p0.png")
    good = [
        {"problem": "<image>What?", "answer": "7", "images": ["pics/p0.png"]},
        {"problem": "Two?", "answer": "2", "images": []},
        {"problem": "Three?", "answer": "3", "images": []},
    ]
    lines = [json.dumps(good[0]), '{"problem": "torn", "answer": ', json.dumps(good[1])]
    lines += ["", "42", "[1, 2]", json.dumps(good[2])]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    stats: Counter[str] = Counter()
    with caplog.at_level("WARNING", logger="vlm_data.loading"):
        rows = load_rows(data, stats=stats)
    assert rows["answer"] == ["7", "2", "3"] and stats["malformed_line"] == 3
    assert Path(rows[0]["images"][0]).parent == data / "pics"
    named = [r.getMessage() for r in caplog.records]
    for number in (2, 5, 6):
        assert any(f"train.jsonl:{number}: skipping a malformed line" in m for m in named)
    assert not list(tmp_path.glob("vlm_data_jsonl_*"))
    # A clean file, and a .json file holding one JSON array, load as before with nothing counted.
    (data / "test.json").write_text(json.dumps(good))
    clean: Counter[str] = Counter()
    assert load_rows(data, split="test", stats=clean)["answer"] == ["7", "2", "3"]
    assert not clean


def test_parquet_with_image_dicts_keeps_bytes_undecoded(tmp_path: Path):
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    features = datasets.Features(
        {
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "problem": ["<image>x"],
            "answer": ["1"],
            "images": [[{"bytes": buffer.getvalue(), "path": None}]],
        },
        features=features,
    )
    ds.to_parquet(tmp_path / "train.parquet")
    rows = load_rows(tmp_path)
    assert rows[0]["images"][0]["bytes"] == buffer.getvalue()


def test_errors_name_the_source_and_say_what_to_pass(tmp_path: Path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetLoadError, match="local parquet"):
        load_rows("someone/not-a-dataset-xyz", split="train")
    (tmp_path / "train.parquet").write_bytes(b"")
    with pytest.raises(DatasetLoadError, match="no file for split 'test'"):
        load_rows(tmp_path, split="test")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetLoadError, match=r"parquet or \.jsonl"):
        load_rows(tmp_path / "notes.txt")
    datasets.Dataset.from_dict({"q": ["a"], "answer": ["1"]}).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(DatasetLoadError, match="missing column"):
        load_rows(tmp_path / "x.parquet")


@pytest.mark.parametrize("name", ["/data/geo3k-x", "./geo3k-x", "../geo3k-x", "~/geo3k-x", "a/b/c"])
def test_a_path_that_is_not_there_is_named_as_a_path(name, monkeypatch, tmp_path):
    """Written as a path, it is never tried on the hub (whose message said "It is not a local
    path either" about `/data/x`); `owner/name` stays a hub name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DatasetLoadError) as err:
        load_rows(name)
    assert str(err.value) == f"{name}: no such file or directory"
    assert not looks_like_path("hiyouga/geometry3k") and looks_like_path(name)


def test_check_dataset_reads_names_only(tmp_path: Path):
    """The launcher's check before anything starts: the training split's files by name."""
    check_dataset(DataConfig(dataset="synthetic:color"))
    check_dataset(DataConfig(dataset="someone/on-the-hub"))  # asked when the rows load
    with pytest.raises(DatasetLoadError, match="no file for split 'train'"):
        check_dataset(DataConfig(dataset=str(tmp_path)))
    (tmp_path / "train.parquet").write_bytes(b"")
    check_dataset(DataConfig(dataset=str(tmp_path)))


def test_custom_keys_work_before_and_after_load_rows_renames_them(tmp_path: Path, tiny):
    from vlm_data.prompts import PromptBuilder
    from vlm_data.synthetic import make_synthetic_rows

    raw = [
        {"question": r["problem"], "label": r["answer"], "pics": r["images"]}
        for r in make_synthetic_rows(3, seed=0)
    ]
    datasets.Dataset.from_list(raw).to_parquet(tmp_path / "train.parquet")
    keys = {"prompt_key": "question", "answer_key": "label", "image_key": "pics"}
    loaded = load_rows(tmp_path, **keys)
    for rows in (raw, loaded):
        builder = PromptBuilder(tiny, **keys)
        assert [s.answer for s in builder.build_all(rows)] == [r["label"] for r in raw]
