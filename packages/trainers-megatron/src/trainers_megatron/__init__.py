"""trainers_megatron: the Megatron-Core actor (TP/SP, packed THD) with the trainer protocol."""

from trainers_megatron.actor import MegatronActor, MicroBatch
from trainers_megatron.config import MegatronConfig

__all__ = ["MegatronActor", "MegatronConfig", "MicroBatch"]
