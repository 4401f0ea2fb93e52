"""``import vlm_models`` must not need megatron-core; ``vlm_models.megatron`` says how to get it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import vlm_models
assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules), "leaked"
sys.modules["megatron"] = None  # as if megatron-core were not installed
try:
    import vlm_models.megatron
except ImportError as err:
    print(err)
else:
    raise SystemExit("vlm_models.megatron imported without megatron-core")
"""


def test_hf_side_does_not_import_megatron_and_missing_install_is_explained():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    assert "uv sync --extra megatron" in out
