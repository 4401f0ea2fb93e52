"""weight_sync: how a trainer's weights reach the rollout engines, in one place.

One protocol (:class:`WeightTransport`, built by a :class:`TransportFactory` over
:class:`EngineLink` s), one bucketer (:func:`iter_weight_buckets`), the check of names against
SGLang's loader (:mod:`~weight_sync.weight_names`), and one module per transport, each holding
its sender and its engine-side half: :mod:`~weight_sync.object_store` (Ray),
:mod:`~weight_sync.cuda_ipc`, :mod:`~weight_sync.nccl`, :mod:`~weight_sync.engine` (in-process)
and :mod:`~weight_sync.disk` (safetensors files). The protocol and the bucketer are the
package's names, imported on first use (`lazy_loader.attach`, PEP 562: they import torch); a transport
is imported from its module (``from weight_sync.disk import Disk``), so only the one a run uses
is loaded (the object store imports Ray).
"""

from __future__ import annotations

import lazy_loader

# every public name not imported above is imported from its module on first use
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "buckets": ["iter_weight_buckets"],
        "protocol": ["EngineLink", "NamedTensors", "TransportFactory", "WeightTransport"],
    },
)
