"""`initialize_model_parallel` in a world of one, in a fresh process (real gloo).

It opens no port and leaves no launcher variable behind: a ``MASTER_PORT`` written to
``os.environ`` reached every Ray worker started later from the same process, and those
trainers failed with EADDRINUSE on the port this process still held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, os
import torch.distributed as dist
from vlm_models.megatron import _cpu_compat, destroy_model_parallel, initialize_model_parallel
_cpu_compat.apply()
initialize_model_parallel()
print(json.dumps({"world": dist.get_world_size(), "rank": dist.get_rank(),
                  "env": sorted(k for k in os.environ if k.startswith("MASTER_"))}))
destroy_model_parallel()
"""


def test_a_world_of_one_needs_no_port_and_writes_no_variable():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"world": 1, "rank": 0, "env": []}
