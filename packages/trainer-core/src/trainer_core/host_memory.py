"""Host memory of an offloaded optimizer step (:mod:`trainer_core.host_adamw`), for the
backends' layout plans; free of torch, as the launchers' planning is."""

from __future__ import annotations

#: elements per host <-> device piece of an offloaded optimizer step: 64M float32 is 256 MiB
CHUNK = 1 << 26


def host_step_bytes(offloaded: float, *, on_cpu: bool = False) -> float:
    """Host bytes of ``offloaded`` parameters stepped by :class:`~trainer_core.host_adamw.HostAdamW`:
    float32 masters and AdamW moments (12 bytes a parameter) and the step's pieces, a float32
    gradient and a bf16 weight buffer of :data:`CHUNK` elements (fewer for a smaller host part),
    two of each. On a GPU they are pinned whole through torch's caching host allocator, which
    rounds each up to a power of two; ``on_cpu`` (the CPU playing the device, as the tests run
    it) they are plain buffers, of which only what the pieces reach is counted, and the
    masters and moments are left to the caller (they are counted with the rest of the state)."""
    if offloaded <= 0:
        return 0.0
    if on_cpu:
        return 6 * min(offloaded, 2 * CHUNK)
    piece = 1 << (int(min(offloaded, CHUNK)) - 1).bit_length()  # the allocator's rounding
    return 12 * offloaded + 2 * piece * (4 + 2)
