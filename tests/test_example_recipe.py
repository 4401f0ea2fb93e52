"""examples/jsonl_math/recipe.py, the README's "Bring your own dataset and reward": a recipe of
its own (a JSONL of text-only problems, its reward, its preset) through rl_runtime's GRPO
entry point. Its hooks in process; then its README command, with fewer steps, on a CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rl_runtime import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "jsonl_math" / "recipe.py"
PROBLEMS = EXAMPLE.parent / "problems.jsonl"


def _example():
    spec = importlib.util.spec_from_file_location("jsonl_math_recipe", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_example_reads_its_problems_and_refuses_a_file_that_is_not_there(tmp_path):
    example = _example()
    cfg = example.RECIPE.parse(["--preset", "tiny"], env={})
    assert cfg.data.dataset == str(PROBLEMS) and cfg.run.backend == "fsdp"
    stats: Counter[str] = Counter()
    rows = example.problems(cfg, "train", eval_split=False, stats=stats)
    assert len(rows) == 24 and not stats
    assert rows[0] == {"problem": "What is 4 + 3?", "answer": "7"}
    torn = tmp_path / "torn.jsonl"
    torn.write_text(PROBLEMS.read_text() + '{"question": "What is 1 +\n\n[1, 2]\n')
    cfg = example.RECIPE.parse(["--preset", "tiny", "--dataset", str(torn)], env={})
    assert len(example.problems(cfg, "test", eval_split=True, stats=stats)) == 24
    assert stats == {"malformed_line": 2}
    missing = str(tmp_path / "none.jsonl")
    cfg = example.RECIPE.parse(["--preset", "tiny", "--dataset", missing], env={})
    with pytest.raises(ConfigError, match=r"^--dataset: .*none\.jsonl: no such file"):
        example.RECIPE.check(cfg)


@pytest.mark.slow  # a real run: Ray, an SFT warm-up and GRPO steps on 2 shared cores
@pytest.mark.timeout(900)
def test_the_readme_command_trains_a_few_grpo_steps(tmp_path):
    run, log = tmp_path / "run", tmp_path / "log.txt"
    uv = shutil.which("uv")
    cmd = [uv, "run", "python"] if uv else [sys.executable]
    cmd += [str(EXAMPLE.relative_to(ROOT)), "--preset", "tiny", "--dataset", str(PROBLEMS)]
    cmd += ["--num-rollout", "2", "--warmup-sft-steps", "4", "--ray-num-cpus", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "GEO3K_"))}
    with open(log, "w") as out:
        done = subprocess.run(
            [*cmd, "--output-dir", str(run)], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    assert "jsonl_math configuration" in text and "SFT warm-up" in text
    assert "GRPO done: 2 steps" in text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the evaluation before training
    assert all(0 <= r["reward_mean"] <= 1 for r in rows[1:])
    assert rows[-1]["eval_accuracy"] is not None and (run / "hf" / "config.json").is_file()
    assert json.loads((run / "config.json").read_text())["data"]["dataset"] == str(PROBLEMS)


def test_the_recipes_stay_short():
    """A recipe is read whole: the example at most 120 lines, each app's main.py (its recipe
    handed to rl_runtime's entry point) at most 150; the assembly lives in rl_runtime."""
    assert len(EXAMPLE.read_text().splitlines()) <= 120
    for main in sorted(ROOT.glob("apps/*/src/*/main.py")):
        assert len(main.read_text().splitlines()) <= 150, main.relative_to(ROOT)
