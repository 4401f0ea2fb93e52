"""Ray start-up and the placement group the trainer ranks and rollout engines live in.

On GPUs a bundle is one GPU (plus a few CPUs); in colocated mode trainer rank i and engine i
share bundle i (each asks for a fraction of the GPU), in separate mode the trainer takes the
first bundles and the engines the rest. An engine with N GPUs (SGLang tensor parallel,
``gpus_per_engine``) gets, in separate mode, one bundle of N GPUs (Ray then shows it exactly
those); colocated, the N one-GPU bundles ``e*N .. e*N+N-1``: it lives in the first and is told
the GPUs of all N (``engine_devices``, probed from Ray), which its worker exports as
``CUDA_VISIBLE_DEVICES`` before SGLang starts its TP ranks on ``cuda:0..N-1``. On CPU the same code runs with CPU-only bundles that ask
for a fraction of a CPU: a placement group holding every CPU would starve the reward workers and
anything else that needs a CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    log_to_driver: bool = True,
) -> None:
    """Connect to an existing cluster (`address`, e.g. "auto" or "ray://host:10001") or start a
    local Ray. No dashboard; nothing is uploaded: workers use this machine's Python."""
    import ray

    if ray.is_initialized():
        return
    _no_uv_runtime_env()
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": log_to_driver}
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
    log.info("Ray resources: %s", ray.cluster_resources())


def _no_uv_runtime_env() -> None:
    """Under `uv run`, Ray would ship the working tree to every worker and rebuild the
    environment there (minutes, and a second copy of the code); our workers share the driver's
    interpreter and code. Ray reads the switch when it is imported, so set the module constant
    too, unless the user chose a value."""
    if "RAY_ENABLE_UV_RUN_RUNTIME_ENV" in os.environ:
        return
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


@dataclass
class Placement:
    """A placement group and how its bundles are shared out."""

    pg: Any
    num_bundles: int
    use_gpu: bool
    colocate: bool
    trainer_bundles: list[int]
    engine_bundles: list[int]
    gpus_per_engine: int = 1
    # colocated engines of several GPUs: each engine's GPU ids (CUDA_VISIBLE_DEVICES), else None
    engine_devices: list[list[str]] | None = None

    @property
    def trainer_gpus(self) -> float:
        """GPUs each trainer rank asks for (a fraction when sharing with an engine)."""
        if not self.use_gpu:
            return 0.0
        return 0.4 if self.colocate else 1.0

    @property
    def engine_gpus(self) -> float:
        if not self.use_gpu:
            return 0.0
        return 0.4 if self.colocate else float(self.gpus_per_engine)

    def strategy(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=False,
        )

    def remove(self) -> None:
        from ray.util import remove_placement_group

        remove_placement_group(self.pg)


def create_placement(
    *,
    num_trainers: int,
    num_engines: int,
    colocate: bool,
    use_gpu: bool,
    cpus_per_bundle: float = 0.5,
    timeout_s: float = 120.0,
    gpus_per_engine: int = 1,
) -> Placement:
    """Reserve the bundles for `num_trainers` ranks and `num_engines` engines.

    Colocated: max(trainers, engines) bundles, shared. Separate: trainers + engines bundles.
    On a GPU cluster each bundle is {GPU: 1, CPU: cpus_per_bundle}; on CPU {CPU: cpus_per_bundle}
    (keep it fractional so other work still finds a CPU).
    """
    import ray
    from ray.util.placement_group import placement_group

    if gpus_per_engine < 1:
        raise ValueError(f"gpus_per_engine must be >= 1, got {gpus_per_engine}")
    per_engine = gpus_per_engine if use_gpu else 1
    bundle: dict[str, float] = {"CPU": cpus_per_bundle}
    if use_gpu:
        bundle["GPU"] = 1.0
    if colocate:
        n = max(num_trainers, num_engines * per_engine)
        trainer_bundles = list(range(num_trainers))
        engine_bundles = [e * per_engine for e in range(num_engines)]
        bundles = [dict(bundle) for _ in range(n)]
    else:
        n = num_trainers + num_engines
        trainer_bundles = list(range(num_trainers))
        engine_bundles = list(range(num_trainers, n))
        engine_bundle = {**bundle, "GPU": float(per_engine)} if use_gpu else bundle
        bundles = [dict(bundle) for _ in trainer_bundles] + [
            dict(engine_bundle) for _ in engine_bundles
        ]
    pg = placement_group(bundles, strategy="PACK")
    ready = pg.wait(timeout_seconds=timeout_s)
    if not ready:
        remove = ray.util.remove_placement_group
        remove(pg)
        raise RuntimeError(
            f"could not reserve {n} bundles of {bundle} within {timeout_s:.0f} s; "
            f"cluster has {ray.available_resources()}"
        )
    log.info(
        "placement group: %s (%s), trainer bundles %s, engine bundles %s",
        bundles,
        "colocated" if colocate else "separate",
        trainer_bundles,
        engine_bundles,
    )
    devices = None
    if colocate and use_gpu and per_engine > 1:
        ids = _bundle_gpu_ids(pg, n)
        devices = [[i for k in range(per_engine) for i in ids[b + k]] for b in engine_bundles]
    return Placement(pg, n, use_gpu, colocate, trainer_bundles, engine_bundles, per_engine, devices)


def _bundle_gpu_ids(pg: Any, n: int) -> list[list[str]]:
    """The GPU ids Ray gives each one-GPU bundle of ``pg`` (a tiny task in each)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def gpu_ids() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    return ray.get(
        [
            gpu_ids.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=b
                )
            ).remote()
            for b in range(n)
        ]
    )
