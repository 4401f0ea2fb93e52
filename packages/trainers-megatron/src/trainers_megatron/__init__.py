"""trainers_megatron: the Megatron-Core actor (TP/SP, packed THD) with the trainer protocol.

The step itself (validation, loss scaling, metrics, skipping non-finite updates) is
``rl_algos.train_step``'s; the actor supplies its hooks. Micro-batches are
``vlm_models.MicroBatch``.
"""

from trainers_megatron.actor import MegatronActor
from trainers_megatron.config import MegatronConfig

__all__ = ["MegatronActor", "MegatronConfig"]
