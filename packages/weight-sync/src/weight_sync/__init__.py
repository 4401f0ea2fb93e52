"""weight_sync: how a trainer's weights reach the rollout engines, in one place.

One protocol (:class:`WeightTransport`, built by a :class:`TransportFactory` over
:class:`EngineLink` s), one bucketer (:func:`iter_weight_buckets`), the check of names against
SGLang's loader (:mod:`~weight_sync.weight_names`), and one module per transport, each holding
its sender and its engine-side half: :mod:`~weight_sync.object_store` (Ray),
:mod:`~weight_sync.cuda_ipc`, :mod:`~weight_sync.nccl`, :mod:`~weight_sync.engine` (in-process)
and :mod:`~weight_sync.disk` (safetensors files). The protocol and the bucketer are the
package's names, imported on first use (PEP 562 `__getattr__`: they import torch); a transport
is imported from its module (``from weight_sync.disk import Disk``), so only the one a run uses
is loaded (the object store imports Ray).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name, by the module that defines it.
_LAZY: dict[str, tuple[str, ...]] = {
    "weight_sync.buckets": ("iter_weight_buckets",),
    "weight_sync.protocol": ("EngineLink", "NamedTensors", "TransportFactory", "WeightTransport"),
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
