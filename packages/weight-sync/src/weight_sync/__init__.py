"""weight_sync: how a trainer's weights reach the rollout engines, in one place.

One protocol (:class:`WeightTransport`, built by a :class:`TransportFactory` over
:class:`EngineLink` s), one bucketer (:func:`iter_weight_buckets`), the check of names against
SGLang's loader (:mod:`~weight_sync.weight_names`), and one module per transport, each holding
its sender and its engine-side half: :mod:`~weight_sync.object_store` (Ray),
:mod:`~weight_sync.cuda_ipc`, :mod:`~weight_sync.nccl`, :mod:`~weight_sync.engine` (in-process)
and :mod:`~weight_sync.disk` (safetensors files). The protocol and the bucketer import here; a
transport is imported from its module (``from weight_sync.disk import Disk``), so only the one a
run uses is loaded (the object store imports Ray).
"""

from weight_sync.buckets import iter_weight_buckets
from weight_sync.protocol import EngineLink, NamedTensors, TransportFactory, WeightTransport

__all__ = [
    "EngineLink",
    "NamedTensors",
    "TransportFactory",
    "WeightTransport",
    "iter_weight_buckets",
]
