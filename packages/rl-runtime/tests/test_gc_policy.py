import gc

import pytest

from rl_runtime import PeriodicGC


@pytest.fixture(autouse=True)
def thawed():
    """Python's default heap, not frozen: the suite's conftest freezes what collection made."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


def test_collects_between_steps_only():
    """Automatic collection is off; the first step's survivors are frozen; full collections
    run after step 1 and after every ``every``-th step (3, 6, ...), nowhere else."""
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    policy = PeriodicGC(every=3)
    gc.callbacks.append(count)
    try:
        assert not gc.isenabled()
        garbage = [[] for _ in range(5000)]  # enough allocations to trigger an automatic pass
        for item in garbage:
            item.append(item)  # reference cycles: only a collection frees them
        del garbage
        assert runs == []
        policy.step()
        assert runs == [2] and gc.get_freeze_count() > 0
        policy.step()
        assert runs == [2]
        policy.step()
        assert runs == [2, 2]
        for _ in range(3):
            policy.step()
        assert runs == [2, 2, 2]
    finally:
        gc.callbacks.remove(count)
        policy.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_python_in_charge():
    policy = PeriodicGC(every=0)
    policy.step()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_heap_frozen_before_stays_frozen():
    """A process that froze its heap before (a trainer's start-up, ``trainer_core.startup``)
    keeps it frozen when the policy closes."""
    gc.freeze()
    policy = PeriodicGC(every=3)
    policy.step()
    policy.close()
    assert gc.isenabled() and gc.get_freeze_count() > 0
