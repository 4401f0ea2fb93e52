"""The Megatron actor's class, imported on call: what a launcher hands rl-runtime beside the
settings (``check_backend``, ``Cluster.train_group``), so that each trainer rank builds
``actor_class()(config)`` in its own process.

Apart from the settings (``config.py``): the actor imports them, so settings that named the
actor would close an import circle. Importing this module loads nothing; the call loads
megatron-core (ImportError where it is not installed, which ``check_backend`` reports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainers_megatron.actor import MegatronActor


def actor_class() -> type[MegatronActor]:
    """:class:`~trainers_megatron.actor.MegatronActor`, imported here (seconds)."""
    from trainers_megatron.actor import MegatronActor

    return MegatronActor
