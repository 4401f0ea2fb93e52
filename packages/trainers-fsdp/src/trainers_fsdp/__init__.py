"""trainers_fsdp: the FSDP2 actor for GRPO and SFT on vision-language models.

``FsdpActor(FsdpConfig(...))`` implements the trainer protocol (``rl_runtime.protocols.TrainActor``):
``compute_logprobs``, ``train_step``, ``iter_hf_weights``, ``save_checkpoint`` /
``load_checkpoint`` / ``export_hf`` and ``offload`` / ``onload``. The parallelism is applied to
a plain transformers model by the small functions of :mod:`trainers_fsdp.parallelize`.

Only the settings import here (`FsdpConfig`, `OptimConfig`); the actor and its parts are
imported from their modules (``from trainers_fsdp.actor import FsdpActor``): they load
torch.distributed and the model code (seconds), and a launcher parses its flags without them.
"""

from trainers_fsdp.config import FsdpConfig, OptimConfig

__all__ = ["FsdpConfig", "OptimConfig"]
