"""A trainer rank that Ray's memory monitor kills ends the run with one line that says so.

The kill is real: a Ray of its own (in a process of its own) whose monitor kills any worker
above 2 % of the node's memory (``RAY_memory_usage_threshold``; every machine is above it),
so the trainer rank's actor is killed as it starts (the 8B Megatron trainer was killed so in
its first train step on the H200, 2026-12-04), and ``ray.get`` raises Ray's
``OutOfMemoryError`` with its multi-line report of the node's memory. The run's line must say the rank was killed for host memory, give
the node's figures and name the settings that size the plan's share of the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Ray's own settings (lower case, as Ray reads them): kill any worker above 2 % of the
#: node's memory, checked every 100 ms
KILL_ALL = {"RAY_memory_usage_threshold": "0.02", "RAY_memory_monitor_refresh_ms": "100"}


class Trainer:
    """A trainer rank's actor that never gets to train."""

    def train_step(self, batch, loss="grpo"):
        return {}


def kill_a_trainer() -> dict[str, object]:
    """In a fresh process started with :data:`KILL_ALL` set: a Ray whose memory monitor kills
    every worker, one trainer rank, and what its group's call raises."""
    import ray

    from rl_runtime import RunStopped, TrainGroup, create_placement, init_ray

    init_ray(num_cpus=1)  # (this module is __main__ here: Ray pickles Trainer by value)
    placement = create_placement(
        num_trainers=1, num_engines=0, colocate=False, use_gpu=False, cpus_per_bundle=0.2
    )
    try:
        group = TrainGroup(Trainer, world_size=1, placement=placement, num_cpus=0.1)
        group.train_step(None)
        return {"raised": None}
    except RunStopped as err:
        indices = getattr(err, "indices", None)
        return {"raised": type(err).__name__, "message": str(err), "indices": indices}
    finally:
        placement.remove()
        ray.shutdown()


@pytest.mark.slow
def test_a_trainer_killed_for_host_memory_stops_the_run_with_one_line_naming_the_settings():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | KILL_ALL
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["raised"] == "OutOfHostMemory", got
    message = got["message"]
    assert "\n" not in message and len(message) < 400, message
    assert message.startswith("trainer rank 0 was killed for host memory during "), message
    assert "Ray's memory monitor: the node had " in message and " GiB in use" in message
    for setting in ("--optimizer-offload-fraction", "--host-memory-gib", "more GPUs"):
        assert setting in message, message
    assert got["indices"] == [0]


if __name__ == "__main__":
    print(json.dumps(kill_a_trainer()))
