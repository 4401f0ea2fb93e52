"""trainer_core: trainer infrastructure shared by the FSDP and Megatron trainers (and the
rollout engine's offload): the packed :class:`MicroBatch` and its builder, pinned host
staging of micro-batches, reused pinned host copies for offloads, and the host threads of an
optimizer step on the CPU.

No settings of its own: every name is imported from its module on first use (PEP 562
`__getattr__`), so importing the package loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name, by the module that defines it.
_LAZY: dict[str, tuple[str, ...]] = {
    "trainer_core.microbatch": ("MicroBatch", "PinnedStaging", "build_micro_batch", "dummy_image"),
    "trainer_core.offload": ("HostCopies", "host_cores", "host_threads", "pinned_empty"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
