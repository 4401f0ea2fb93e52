"""trainers_megatron: the Megatron-Core actor (TP/SP, packed THD) with the trainer protocol.

The step itself (validation, loss scaling, metrics, skipping non-finite updates) is
``rl_algos.train_step``'s; the actor supplies its hooks. Micro-batches are
``trainer_core.MicroBatch``.

Only the settings import here (`MegatronConfig`); the actor is imported from its module
(``from trainers_megatron.actor import MegatronActor``): megatron-core takes seconds and warns
where Transformer Engine is missing, and a launcher parses its flags without it.
"""

from trainers_megatron.config import MegatronConfig

__all__ = ["MegatronConfig"]
