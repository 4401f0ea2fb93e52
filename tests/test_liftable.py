"""rewards-math, rl-algos and vlm-data stand alone (docs/architecture.md) so that a user can add
them to a project of their own, on their own torch: they declare version ranges, never the
workspace's exact pins (those belong in `uv.lock`), and need no other workspace package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LIFTABLE = ("rewards-math", "rl-algos", "vlm-data")
WORKSPACE = {
    canonicalize_name(tomllib.loads(p.read_text())["project"]["name"])
    for p in ROOT.glob("*/*/pyproject.toml")
}
# The oldest torch this machine's pip finds on disk (a CPU build, see the test below).
OLDER_TORCH = "2.13.0"


def _pyproject(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


def _requirements(package: str) -> list[Requirement]:
    project = _pyproject(package)["project"]
    extras = project.get("optional-dependencies", {}).values()
    return [Requirement(r) for r in [*project["dependencies"], *(r for e in extras for r in e)]]


@pytest.mark.parametrize("package", LIFTABLE)
def test_liftable_package_pins_no_exact_version(package: str) -> None:
    """`torch==2.14.1` in rl-algos made it uninstallable beside any other torch ("your
    requirements are unsatisfiable")."""
    for req in _requirements(package):
        exact = [s for s in req.specifier if s.operator in ("==", "===") and "*" not in s.version]
        assert not exact, f"{package} pins {req}: declare the range it works with"


@pytest.mark.parametrize("package", LIFTABLE)
def test_liftable_package_on_torch_declares_numpy_and_names_the_cpu_index(package: str) -> None:
    """rl-algos' README example in a fresh venv pulled PyPI's torch with 2.5 GB of CUDA wheels
    and printed torch's "Failed to initialize NumPy" (numpy was not declared)."""
    names = {canonicalize_name(req.name) for req in _requirements(package)}
    if "torch" not in names:
        return
    assert "numpy" in names, f"{package} takes torch but not numpy"
    readme = (ROOT / "packages" / package / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert f"uv pip install --torch-backend cpu ./packages/{package}" in readme


@pytest.mark.parametrize("package", LIFTABLE)
def test_liftable_package_needs_no_workspace_package(package: str) -> None:
    names = {canonicalize_name(req.name) for req in _requirements(package)}
    assert not names & WORKSPACE, f"{package} depends on {names & WORKSPACE}"


_SMOKE = r"""
import json, torch, rewards_math, rl_algos
from rl_algos import (GrpoLossConfig, aligned_logprobs, broadcast_advantages,
                      compute_grpo_advantages, grpo_loss, pack_sequences)
responses = ["so $\\boxed{4\\sqrt{2}}$", "\\boxed{\\sqrt{32}}", "\\boxed{5.66}", "no answer"]
rewards = torch.tensor([rewards_math.compute_score(r, "4\\sqrt{2}") for r in responses])
adv = compute_grpo_advantages(rewards, group_size=4)
ids, cu = pack_sequences([torch.arange(6) for _ in responses])
mask = [torch.tensor([0, 0, 1, 1, 1, 1.0]) for _ in responses]
advantages, _ = pack_sequences(broadcast_advantages(adv, mask))
logits = torch.randn(ids.shape[0], 8, requires_grad=True)
logprobs = aligned_logprobs(logits, ids, cu)
loss, _ = grpo_loss(logprobs, old_logprobs=logprobs.detach(), advantages=advantages,
                    loss_mask=pack_sequences(mask)[0], cu_seqlens=cu, config=GrpoLossConfig())
loss.backward()
print(json.dumps({"torch": torch.__version__, "rewards": rewards.tolist(),
                  "grad": bool(logits.grad.abs().sum() > 0),
                  "files": [rl_algos.__file__, rewards_math.__file__]}))
"""


def _readme_examples(package: str) -> list[str]:
    """The runnable ```python blocks of a package's README (not those marked no-run)."""
    text = (ROOT / "packages" / package / "README.md").read_text()
    blocks = re.findall(r"^(<!-- no-run[^\n]*\n)?```python\n(.*?)^```", text, re.M | re.S)
    return [code for skip, code in blocks if not skip]


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def _older_torch_wheel(pip: list, tmp: Path) -> str | None:
    """The torch wheel pip resolves with no index (its find-links only), or None."""
    report = tmp / "report.json"
    out = _run([*pip, "install", "--dry-run", "--no-index", "--no-deps", "--ignore-installed",
                "--report", report, f"torch=={OLDER_TORCH}"])  # fmt: skip
    if out.returncode or not report.is_file():
        return None
    url = json.loads(report.read_text())["install"][0]["download_info"]["url"]
    return url2pathname(urlparse(url).path)


@pytest.mark.slow
def test_rl_algos_and_rewards_math_install_beside_an_older_torch(tmp_path: Path) -> None:
    """A fresh venv holding torch 2.13.0 (a CPU build, as PyTorch's CPU index serves it) takes
    rl-algos and rewards-math without touching its torch, and a reward, GRPO advantages and a
    GRPO loss's backward run there; so do the two READMEs' examples, as scripts, and print no
    warning (rl-algos' printed torch's "Failed to initialize NumPy": numpy was undeclared)."""
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # as activated: uv-build
    try:
        _run([sys.executable, "-m", "venv", venv], check=True)
        python = str(venv / "bin" / "python")
        pip = [python, "-m", "pip", "--disable-pip-version-check", "--retries", "1"]
        wheel = _older_torch_wheel(pip, tmp_path)
        if wheel is None:
            pytest.skip(f"no torch {OLDER_TORCH} wheel that pip finds offline (its find-links)")
        # What the two packages need besides torch, and their build backend, from pip's usual
        # sources (this machine: local indexes and PyPI); then the packages themselves offline.
        needs = [str(r) for r in _requirements("rewards-math")]
        needs += [str(r) for r in _requirements("rl-algos") if r.name != "torch"]
        needs += _pyproject("rl-algos")["build-system"]["requires"]
        out = _run([*pip, "install", "--no-compile", "--timeout", "30", wheel, *needs], env=env)
        if out.returncode:
            pytest.skip(f"torch {OLDER_TORCH}'s and rewards-math's dependencies do not install "
                        f"here: {out.stderr.strip()[-300:]}")  # fmt: skip
        out = _run([*pip, "install", "--no-compile", "--no-index", "--no-build-isolation",
                    ROOT / "packages" / "rl-algos", ROOT / "packages" / "rewards-math",
                    f"torch=={OLDER_TORCH}"], env=env)  # fmt: skip
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        out = _run([python, "-c", _SMOKE], cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["torch"].startswith(OLDER_TORCH)
        assert result["rewards"] == [1.0, 1.0, 0.0, 0.0]
        assert result["grad"]
        assert all(str(venv) in f for f in result["files"]), result["files"]  # not the checkout's
        for package in ("rl-algos", "rewards-math"):
            for i, code in enumerate(_readme_examples(package)):
                script = tmp_path / f"{package}_{i}.py"
                script.write_text(code)
                out = _run([python, script], cwd=tmp_path, env=env)
                assert out.returncode == 0, f"{package} README: {out.stderr[-3000:]}"
                assert "Warning" not in out.stderr, f"{package} README: {out.stderr[-3000:]}"
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about 1 GB; pytest keeps its last 3 tmp folders
