"""weight_sync: how a trainer's weights reach the rollout engines, in one place.

One protocol (:class:`WeightTransport`, built by a :class:`TransportFactory` over
:class:`EngineLink` s), one bucketer (:func:`iter_weight_buckets`), the check of names against
SGLang's loader (:mod:`~weight_sync.weight_names`), and one module per transport, each holding
its sender and its engine-side half: :mod:`~weight_sync.object_store` (Ray),
:mod:`~weight_sync.cuda_ipc`, :mod:`~weight_sync.nccl`, :mod:`~weight_sync.engine` (in-process)
and :mod:`~weight_sync.disk` (safetensors files). The protocol and the bucketer import at once;
a transport loads its module on first use (the object store imports Ray).
"""

import importlib
from typing import Any

from weight_sync.buckets import iter_weight_buckets
from weight_sync.protocol import EngineLink, NamedTensors, TransportFactory, WeightTransport

_EXPORTS: dict[str, tuple[str, ...]] = {
    "cuda_ipc": ("CudaIpc", "CudaIpcTransport", "flattened_bucket_payloads"),
    "disk": ("Disk", "DiskTransport", "load_bucket_files", "read_bucket"),
    "engine": ("EngineTransport", "weight_update_session"),
    "nccl": (
        "DistributedWeightSender",
        "LinkedEngine",
        "Nccl",
        "bucket_spec",
        "init_weight_sync_group",
    ),
    "object_store": ("ObjectStore", "ObjectStoreTransport", "RemoteEngine"),
    "weight_names": ("WeightNameCheck", "check_weight_names", "sglang_param_name"),
}
_LAZY = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name of `_EXPORTS`, imported once; afterwards a plain attribute."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


__all__ = [
    "EngineLink",
    "NamedTensors",
    "TransportFactory",
    "WeightTransport",
    "iter_weight_buckets",
    *_LAZY,
]
