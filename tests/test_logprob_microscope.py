"""``tools/logprob_microscope.py`` end to end on the CPU: a tiny Qwen3.5-MoE folder built from the
preset (the real processor), text prompts, float32; every path agrees with transformers' forward to
float32 rounding and the JSON holds the per-layer comparison and the kernels each path ran."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "logprob_microscope", ROOT / "tools" / "logprob_microscope.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_microscope_runs_every_path_and_writes_its_report(tmp_path):
    out = tmp_path / "micro.json"
    _tool().main(
        [
            "--shape", "qwen3.5-moe-tiny", "--work-dir", str(tmp_path), "--text",
            "--prompts", "2", "--samples", "2", "--max-new-tokens", "6",
            "--trainers", "fsdp", "--dtypes", "float32", "--out", str(out),
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())["float32"]
    paths = result["against_forward"]
    assert {"engine", "decode", "decode-replay", "fsdp"} <= set(paths)
    assert all(p["mean_gap"] < 1e-5 for p in paths.values()), paths
    assert paths["decode"]["parts_at"] is None
    assert len(paths["decode"]["layers"]) == 4  # the tiny preset's layers, each compared
    assert result["kernels"]["decode_attention"] == "sdpa"
    assert result["samples"] == 4
