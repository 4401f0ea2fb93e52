"""trainer_core: trainer infrastructure shared by the FSDP and Megatron trainers (and the
rollout engine's offload): the packed :class:`MicroBatch` and its builder, pinned host
staging of micro-batches, reused pinned host copies for offloads, the host threads of an
optimizer step on the CPU, and the walk that counts the tensor storages an actor keeps.

No settings of its own: every name is imported from its module on first use
(`lazy_loader.attach`, PEP 562 `__getattr__`), so importing the package loads no torch.
"""

from __future__ import annotations

import lazy_loader

# every public name not imported above is imported from its module on first use
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "microbatch": [
            "MicroBatch",
            "PinnedStaging",
            "build_micro_batch",
            "dummy_image",
            "replays_routes",
        ],
        "held": ["device_bytes", "held_storages", "storage_ptrs"],
        "offload": ["HostCopies", "host_cores", "host_threads", "pinned_empty"],
    },
)
