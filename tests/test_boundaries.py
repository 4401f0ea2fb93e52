"""Dependencies point one way (docs/architecture.md): no app imports another app, rl-runtime
knows the trainer and engine protocols but no trainer or engine package, no source file imports
itself back through others, and a launcher parses its flags without loading the model code its
packages keep for later."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APPS = {p.name: p for p in sorted((ROOT / "apps").iterdir()) if (p / "pyproject.toml").is_file()}
BACKENDS = {"rollout_sglang", "trainers_fsdp", "trainers_megatron", "sglang", "megatron"}


def _imports(folder: Path) -> list[tuple[Path, str]]:
    """(file, module) for every import under `folder`, `importlib.import_module("x")` included."""
    found = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append((path, node.module))
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in _DYNAMIC
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.append((path, node.args[0].value))
    return found


_DYNAMIC = {"import_module", "__import__", "find_spec"}


def _dependencies(project: Path) -> set[str]:
    deps = tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    return {d.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for d in deps}


@pytest.mark.parametrize("app", sorted(APPS))
def test_no_app_imports_another(app: str) -> None:
    others = {name for name in APPS if name != app}
    for path, module in _imports(APPS[app]):
        assert module.split(".")[0] not in others, f"{path.relative_to(ROOT)} imports {module}"
    assert not _dependencies(APPS[app]) & {o.replace("-", "_") for o in others}


def test_rl_runtime_imports_no_trainer_or_engine() -> None:
    """rl-runtime knows the protocols; the app picks the concrete trainer, engine, transport."""
    package = ROOT / "packages" / "rl-runtime"
    for path, module in _imports(package / "src"):
        assert module.split(".")[0] not in BACKENDS, f"{path.relative_to(ROOT)} imports {module}"
    assert not _dependencies(package) & BACKENDS
    assert not {d for d in _dependencies(package) if d.startswith("trainers_")}


def _source_modules() -> dict[str, Path]:
    """Every source module of the packages and apps (``packages/*/src``, ``apps/*/src``) by
    its dotted name; a package by its ``__init__.py``."""
    modules = {}
    for src in sorted([*ROOT.glob("packages/*/src"), *ROOT.glob("apps/*/src")]):
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which source modules each one imports, by any import statement in its file: at the
    top, inside a function (a lazy import) or under ``TYPE_CHECKING``. ``from pkg import x``
    names the module ``pkg.x`` where there is one, else ``pkg``; a submodule's import is not
    counted as one of its parent package (Python runs the parent first, whatever imports it)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles() -> None:
    """No source module reaches itself through its imports, lazy ones included: a settings
    module holds settings, and what builds from them imports them (never the other way)."""
    modules = _source_modules()
    graph = _import_graph(modules)
    lines = []
    for circle in _circles(graph):
        ties = [f"{a} -> {b}" for a in circle for b in sorted(graph[a] & set(circle))]
        lines.append(f"{', '.join(circle)} ({'; '.join(ties)})")
    assert not lines, "import circles:\n" + "\n".join(lines)


@pytest.mark.slow  # two interpreters importing torch
@pytest.mark.parametrize("app", sorted(APPS))
def test_parsing_loads_no_model_code(app: str) -> None:
    """The packages' configs import at once and the rest on first use: a launcher's --help, a
    bad flag and --print-config of a CPU run neither wait for transformers or megatron-core
    nor print megatron-core's warnings."""
    code = (
        f"import sys; from {app}.main import parse\n"
        "cfg = parse(['--preset', 'tiny'], env={})\n"
        "heavy = [m for m in ('transformers', 'megatron.core', 'sglang') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]
