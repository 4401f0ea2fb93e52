"""A trainer rank's start-up phases are logged with their times, so a hang names its phase."""

import gc
import logging
import sys

import pytest

from trainer_core.startup import StartupLog, resident_gib


def test_each_phase_is_logged_when_it_begins_and_with_its_time_when_it_ends(caplog):
    log = StartupLog("megatron trainer rank 0")
    with caplog.at_level(logging.INFO, logger="glimpse.startup"):
        with log.phase("process groups"):
            pass
        with pytest.raises(RuntimeError), log.phase("model"):
            raise RuntimeError("stuck")  # the begun phase is the last line
        log.done()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "megatron trainer rank 0: process groups ..."
    assert lines[1].startswith("megatron trainer rank 0: process groups done in ")
    assert lines[2] == "megatron trainer rank 0: model ..."
    assert "model done" not in " ".join(lines)
    assert list(log.phases) == ["process groups"]
    assert lines[-1].startswith("megatron trainer rank 0: ready in ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_phase_gives_freed_heap_memory_back_and_logs_what_stays_resident(caplog):
    """Many mid-sized blocks freed in a phase (a checkpoint loaded on the host, then moved)
    stay in glibc's heap until trimmed; the phase's end trims and reports the resident set."""
    log = StartupLog("fsdp trainer rank 0")
    before = resident_gib()
    with caplog.at_level(logging.INFO, logger="glimpse.startup"), log.phase("model"):
        blocks = [bytearray(64 << 10) for _ in range(8192)]  # 512 MiB below mmap's threshold
        del blocks[:-1]  # the last one keeps the heap's top in use
    after = resident_gib()
    assert before is not None and after is not None
    assert after - before < 0.25, (before, after)  # without the trim, ~0.5 GiB stays
    assert "GiB host memory resident" in caplog.records[-1].getMessage()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_phase_frees_what_it_dropped_in_a_reference_cycle():
    """megatron-core drops its first hybrid optimizer (float32 copies of the offloaded part) in
    a reference cycle; with automatic collection off, as in a trainer process once built, the
    phase's end still frees it before it reports the resident set."""
    log = StartupLog("megatron trainer rank 0")
    gc.disable()
    try:
        before = resident_gib()
        with log.phase("DDP and optimizer"):
            dropped: dict = {"copies": bytearray(b"\x01") * (512 << 20)}  # pages written
            dropped["self"] = dropped  # unreachable once the name goes, but not freed
            del dropped
        after = resident_gib()
    finally:
        gc.enable()
    assert before is not None and after is not None
    assert after - before < 0.25, (before, after)  # the cycle alone holds 0.5 GiB


FRESH = """
import gc, json, weakref
from trainer_core.startup import StartupLog

class Node:
    pass

log = StartupLog("fsdp trainer rank 0")
frozen = gc.get_freeze_count()
gc.disable()  # only the phase's own collection may free the cycle
with log.phase("model"):
    dropped = Node()
    dropped.self = dropped  # a cycle start-up drops
    ref = weakref.ref(dropped)
    del dropped
print(json.dumps({"frozen": frozen, "freed": ref() is None}))
"""


def test_start_up_freezes_what_the_process_held_before_once():
    """In a fresh process the first start-up collects and freezes what the imports made, so
    its phases' collections walk only what start-up makes; what start-up drops in a cycle is
    still collected by the phase's end. A process that froze its heap before (this test
    session, after collection) is left as it is."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 1000 and got["freed"]
    before = gc.get_freeze_count()
    StartupLog("fsdp trainer rank 1")
    assert gc.get_freeze_count() == before
