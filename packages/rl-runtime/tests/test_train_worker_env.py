"""What a trainer rank sees of the launcher variables (the class Ray runs, in this process).

A world of one must build its trainer in a world of its own, whatever the driver's shell left
in the environment: CI once failed because an earlier in-process test left ``MASTER_PORT``
set, every later trainer inherited it through Ray and bound the port that test still held.
"""

from __future__ import annotations

import os

import pytest

from rl_runtime.workers import TrainWorker

LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _seen_environment() -> dict[str, str]:
    return {k: os.environ[k] for k in LAUNCHER_KEYS if k in os.environ}


@pytest.fixture
def inherited(monkeypatch):
    for key, value in zip(LAUNCHER_KEYS, ("3", "8", "1", "10.0.0.9", "48669"), strict=True):
        monkeypatch.setenv(key, value)


def test_a_world_of_one_drops_inherited_launcher_variables(inherited):
    worker = TrainWorker(0, 1, None, None, _seen_environment)
    assert worker.actor == {}


def test_ranks_of_a_larger_world_get_the_groups_rendezvous(inherited):
    worker = TrainWorker(1, 2, "127.0.0.1", 29700, _seen_environment)
    assert worker.actor == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29700",
    }
