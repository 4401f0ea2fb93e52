"""The FSDP actor's class, imported on call: what a launcher hands rl-runtime beside the
settings (``check_backend``, ``Cluster.train_group``), so that each trainer rank builds
``actor_class()(config)`` in its own process.

Apart from the settings (``config.py``): the actor imports them, so settings that named the
actor would close an import circle. Importing this module loads nothing; the call loads
torch.distributed and the model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers_fsdp.actor import FsdpActor


def actor_class() -> type[FsdpActor]:
    """:class:`~trainers_fsdp.actor.FsdpActor`, imported here (seconds)."""
    from trainers_fsdp.actor import FsdpActor

    return FsdpActor
