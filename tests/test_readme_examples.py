"""The docs run as written: every ```python block of README.md, docs/*.md and the packages' and
apps' READMEs runs on a CPU (one process, each block in a fresh namespace, `../shared` beside
its folder being GLIMPSE_SHARED as in a checkout), unless the line before it says why it cannot
(`<!-- no-run: needs a GPU -->`); every launcher command line in a ```bash block names only
flags its launcher knows, and a `--flag` in backticks in the prose is one a launcher knows
(or an allowed flag of another tool)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("packages/*/README.md")),
    *sorted(ROOT.glob("apps/*/README.md")),
]
LAUNCHERS = {"geo3k_grpo": "geo3k_grpo", "geo3k-grpo": "geo3k_grpo", "geo3k_sft": "geo3k_sft",
             "geo3k-sft": "geo3k_sft"}  # fmt: skip
#: The example recipes (`examples/<name>/recipe.py`), launchers too: `RECIPE.parse`.
EXAMPLES = {p.parent.name: p for p in sorted(ROOT.glob("examples/*/recipe.py"))}
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


# --- flags ----------------------------------------------------------------------------------

# Flags of other tools that the docs name in backticks without their command: SGLang's server
# (set by rollout-sglang), Ray's CLI, pip's and uv's; and the recipes' flags that the migration
# table's right column names as what we do not mirror.
OTHER_TOOLS = {
    "--enable-weights-cpu-backup", "--enable-deterministic-inference", "--mm-process-config",
    "--host", "--head", "--address", "--no-build-isolation", "--no-deps", "--locked",
    "--compile-bytecode", "--package",
    "--micro-batch-size", "--qkv-format", "--sglang-disable-custom-all-reduce",
    "--te", "--json",  # tools/convert_*.py's, tools/soak.py's
    "--text", "--shape", "--layers",  # tools/logprob_microscope.py's
    "--num-roll",  # the misspelt flag the docs show being refused
}  # fmt: skip


@cache
def launcher_help(app: str) -> str:
    """`app`'s --help (nothing runs)."""
    if app in EXAMPLES:
        spec = importlib.util.spec_from_file_location(f"example_{app}", EXAMPLES[app])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        parse = module.RECIPE.parse
    else:
        parse = importlib.import_module(f"{app}.main").parse
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        parse(["--help"], env={})
    return help_text.getvalue()


@cache
def launcher_flags(app: str) -> frozenset[str]:
    """The option strings of `app`'s parser, read off its --help."""
    flags = set()
    for line in launcher_help(app).splitlines():
        if line.strip().startswith("-"):
            options = re.split(r"\s{2,}", line.strip())[0]  # before the help text
            flags |= set(re.findall(r"--[\w.-]+", options))
    assert "--print-config" in flags and "--lr" in flags, launcher_help(app)[:2000]
    return frozenset(flags)


ENV_NAME = re.compile(r"\b(?:GEO3K|MILES_SCRIPT|SLIME_SCRIPT)_[A-Z0-9_]+\b")


@cache
def launcher_env_names() -> frozenset[str]:
    """The environment names either launcher reads (its --help lists them as `[env: ...]`)."""
    return frozenset(
        name
        for app in ("geo3k_grpo", "geo3k_sft")
        for env in re.findall(r"\[env: ([^\]]+)\]", launcher_help(app).replace("\n", " "))
        for name in ENV_NAME.findall(env)
    )


def _flags(text: str) -> list[str]:
    return [f.split("=")[0] for f in re.findall(r"(?<![\w-])--[A-Za-z][\w.-]*(?:=\S*)?", text)]


def _launcher(text: str) -> str | None:
    """The launcher a command line runs (`uv run apps/geo3k_grpo ...`, `geo3k-sft ...`,
    `uv run python examples/jsonl_math/recipe.py ...`)."""
    example = re.search(r"examples/(\w+)/recipe\.py", text)
    if example and example.group(1) in EXAMPLES:
        return example.group(1)
    found = re.search(r"(?:apps/|^|\s)(geo3k[_-](?:grpo|sft))\b", text)
    return LAUNCHERS[found.group(1)] if found else None


def _command_lines(code: str) -> list[str]:
    """Shell lines of a bash block, continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [re.sub(r"(^|\s)#.*$", "", line) for line in joined.splitlines()]


def _launcher_commands() -> list[tuple[str, str, str]]:
    """(where, launcher, command line) for every launcher run in a bash block."""
    found = []
    for block in BLOCKS:
        if block.lang not in ("bash", "sh", "shell", "console"):
            continue
        for n, line in enumerate(_command_lines(block.code)):
            app = _launcher(line)
            if app:
                found.append((f"{block.id}+{n}", app, line))
    return found


LAUNCHER_COMMANDS = _launcher_commands()


@pytest.mark.parametrize(("where", "app", "line"), LAUNCHER_COMMANDS, ids=lambda x: str(x)[:60])
def test_launcher_command_names_known_flags(where: str, app: str, line: str) -> None:
    unknown = [f for f in _flags(line.split(app, 1)[1]) if f not in launcher_flags(app)]
    assert not unknown, f"{where}: {app} has no {unknown}: {line.strip()}"


def _prose_flags(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, flag, launcher or None for either) for each `--flag` in backticks outside code
    blocks, where the span is a bare flag (`--lr 1e-6`) or a launcher's command. Spans that run
    another command (`ray start --head`, `python tools/...`) and the left column of the table
    of the recipes' flags (headed `miles / slime`) are not checked."""
    found, in_code, recipe_table = [], False, False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("|"):
            cells = line.split("|")[1:-1]
            if "miles" in cells[0] or "slime" in cells[0]:
                recipe_table = True
            if recipe_table:
                line = "|".join(cells[1:])
        else:
            recipe_table = False
        for span in re.findall(r"`([^`\n]+)`", line):
            app = _launcher(span)
            if app is None and not span.startswith("--"):
                continue
            found += [(n, flag, app) for flag in _flags(span)]
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_flags_and_environment_names_in_prose_are_known(path: Path) -> None:
    """architecture.md named `--sft-warmup-steps`; the flag is `--warmup-sft-steps`."""
    either = launcher_flags("geo3k_grpo") | launcher_flags("geo3k_sft") | OTHER_TOOLS
    unknown = [
        f"{path.name}:{n} {flag}"
        for n, flag, app in _prose_flags(path)
        if flag not in (launcher_flags(app) if app else either)
    ]
    assert "GEO3K_NUM_GPUS" in launcher_env_names()
    unknown += [
        f"{path.name} {name}"
        for name in ENV_NAME.findall(path.read_text())
        if name not in launcher_env_names()
    ]
    assert not unknown, f"flags or environment names no launcher knows: {unknown}"


def test_readme_variable_table_lists_every_variable_the_launchers_read() -> None:
    """`GEO3K_OUTPUT_DIR`, `GEO3K_PRESET` and `GEO3K_WANDB` were in `--help` but not the table."""
    rows = re.findall(r"^\| `(GEO3K_[A-Z0-9_]+)` \|", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) == len(set(rows)), rows
    known = {name for name in launcher_env_names() if name.startswith("GEO3K_")}
    assert set(rows) == known, f"missing: {known - set(rows)}; unknown: {set(rows) - known}"
