"""The in-process transport and the package's import boundaries."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from weight_sync.engine import EngineTransport, weight_update_session

SRC = Path(__file__).resolve().parents[1] / "src" / "weight_sync"


def test_engine_transport_hands_every_bucket_to_every_engine():
    got: list = []

    class Engine:
        def update_weights(self, buckets):
            got.append([[n for n, _ in b] for b in buckets])

    buckets = iter([[("a", torch.ones(1))], [("b", torch.ones(1)), ("c", torch.ones(1))]])
    assert EngineTransport([Engine(), Engine()]).send(buckets) == 3
    assert got == [[["a"], ["b", "c"]]] * 2  # a one-shot iterator reaches both engines


def test_a_failed_update_still_closes_the_session():
    calls: list[str] = []

    class Engine:
        def begin_weight_update(self):
            calls.append("begin")

        def end_weight_update(self):
            calls.append("end")

    try:
        with weight_update_session(Engine()):
            raise ValueError("bucket")
    except ValueError:
        pass
    assert calls == ["begin", "end"]


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    body = [n for top in tree.body for n in (top.body if isinstance(top, ast.Try) else [top])]
    for node in body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_weight_sync_imports_neither_runtime_nor_engines_and_ray_only_in_the_object_store():
    """Dependencies point into weight_sync: rl-runtime and the rollout package import it."""
    for path in SRC.glob("*.py"):
        every = {
            (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Import | ast.ImportFrom) and not getattr(n, "level", 0)
            for a in (n.names if isinstance(n, ast.Import) else [None])
        }
        assert not every & {"rl_runtime", "rollout_sglang", "vlm_models"}, path.name
        top = _top_level_imports(path)
        assert ("ray" in top) == (path.name == "object_store.py"), path.name
        assert "sglang" not in top, path.name
