"""The docs run as written: every ```python block of README.md, docs/*.md and the packages' and
apps' READMEs runs on a CPU (one process, each block in a fresh namespace, `../shared` beside
its folder being GLIMPSE_SHARED as in a checkout), unless the line before it says why it cannot
(`<!-- no-run: needs a GPU -->`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("packages/*/README.md")),
    *sorted(ROOT.glob("apps/*/README.md")),
]
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(.+?)\s*-->\s*$")  # a line of its own


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    no_run: str | None  # the reason given in the line before, if any

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2), i
        i += 1
        while not lines[i].strip().startswith("```"):
            i += 1
        code = "\n".join(line.removeprefix(indent) for line in lines[start + 1 : i])
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = NO_RUN.search(before)
        blocks.append(Block(path, start + 1, lang, code, mark.group(1) if mark else None))
        i += 1
    # A mark before a block of another language, or lost in a reflow, would skip nothing.
    python = {b.line - 1 for b in blocks if b.lang == "python"}
    for n, line in enumerate(lines):
        following = next((j for j in range(n + 1, len(lines)) if lines[j].strip()), None)
        if NO_RUN.search(line) and following not in python:
            raise ValueError(f"{path}:{n + 1}: a no-run mark not just before a python block")
    return blocks


BLOCKS = [b for path in DOCS for b in _blocks(path)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]

# Runs each block in a fresh namespace, as `python -c` would run it (the workers of a spawned
# pool import nothing of the caller's), and writes each block's traceback or None.
_WORKER = """
import json, sys, traceback
blocks, out = json.load(open(sys.argv[1])), {}
for block in blocks:
    try:
        exec(compile(block["code"], block["id"], "exec"), {"__name__": "__main__"})
        out[block["id"]] = None
    except BaseException:
        out[block["id"]] = traceback.format_exc()[-4000:]
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict[str, str | None]:
    shared = Path(os.environ.get("GLIMPSE_SHARED", ROOT.parent / "shared")).resolve()
    if not shared.is_dir():
        pytest.skip(f"{shared} not found: set GLIMPSE_SHARED (the examples read ../shared)")
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "shared").symlink_to(shared)  # the examples' ../shared, as beside a checkout
    work = tmp / "work"
    work.mkdir()
    runnable = [{"id": b.id, "code": b.code} for b in PYTHON if b.no_run is None]
    (tmp / "blocks.json").write_text(json.dumps(runnable))
    env = {**os.environ, "GLIMPSE_SHARED": str(shared), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, tmp / "blocks.json", tmp / "results.json"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.slow  # one process importing torch, transformers and the real processor
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_runs(block: Block, python_results) -> None:
    if block.no_run is not None:
        pytest.skip(f"marked no-run: {block.no_run}")
    error = python_results[block.id]
    assert error is None, f"{block.id} raised:\n{error}"
