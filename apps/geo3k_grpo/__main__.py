"""Entry point for `uv run apps/geo3k_grpo`."""

import os
import sys

# Ray must not rebuild this uv environment on its workers (see rl_runtime.init_ray).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from geo3k_grpo.main import main

if __name__ == "__main__":
    main(sys.argv[1:])
