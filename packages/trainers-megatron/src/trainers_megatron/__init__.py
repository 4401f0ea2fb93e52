"""trainers_megatron: the Megatron-Core actor (TP/SP, packed THD) with the trainer protocol.

The step itself (validation, loss scaling, metrics, skipping non-finite updates) is
``rl_algos.train_step``'s; the actor supplies its hooks. Micro-batches are
``trainer_core.MicroBatch``.

`MegatronConfig` imports at once; `MegatronActor` loads on first use (megatron-core: seconds,
and warnings where Transformer Engine is missing), so a launcher parses its flags without it.
"""

import importlib
from typing import Any

from trainers_megatron.config import MegatronConfig

_EXPORTS: dict[str, tuple[str, ...]] = {
    "actor": ("MegatronActor",),
}
_LAZY = {name: f"{__name__}.{module}" for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name of `_EXPORTS`, imported once; afterwards a plain attribute."""
    module = _LAZY.get(name)
    if module is None:
        if name in globals():  # loaded by another thread meanwhile
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    _LAZY.pop(name, None)
    return value


__all__ = ["MegatronConfig", *_LAZY]
