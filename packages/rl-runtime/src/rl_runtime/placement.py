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

import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_runtime import ray_reaper
from rl_runtime.placement_plan import check_fits, nodes
from rl_runtime.preflight import PreflightError
from rl_runtime.progress import plain_logs
from rl_runtime.ray_join import check_cluster
from rl_runtime.ray_logs import quiet_token_notice, route_ray_logs, route_worker_lines

log = logging.getLogger(__name__)


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    log_to_driver: bool = True,
    attempts: int = 4,
    retry_wait_s: float = 5.0,
) -> None:
    """Connect to an existing cluster (`address`, e.g. "auto" or "ray://host:10001") or start a
    local Ray. No dashboard; nothing is uploaded: workers use this machine's Python.

    On a busy machine Ray's start can time out ("The current node timed out during startup"):
    it is tried `attempts` times, `retry_wait_s` apart (growing), then a `PreflightError` says
    what failed in one line. A local Ray gets a reaper process (`ray_reaper.py`) that removes
    every process of its session once this driver is gone, even after a SIGKILL.

    Where the log is plain lines (`rl_runtime.progress.setup_logging`), Ray's own records and
    its workers' lines are logged in that layout (`rl_runtime.ray_logs`)."""
    import ray

    if ray.is_initialized():
        return
    _no_uv_runtime_env()
    if plain_logs():
        route_ray_logs()
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": log_to_driver}
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        kwargs["address"] = address
        check_cluster(address)
        attempts = 1  # a refused token or an empty address stays so on retry
    else:
        # "local": a new Ray of our own, even where `ray start` ran on this machine before
        # (a bare ray.init() would join the cluster named in /tmp/ray/ray_current_cluster)
        kwargs |= {"address": "local", "num_cpus": num_cpus, "num_gpus": num_gpus}
    for attempt in range(1, attempts + 1):
        before = ray_reaper.descendants(os.getpid())
        try:
            with contextlib.nullcontext() if address else quiet_token_notice():
                ray.init(**kwargs)
            break
        except Exception as err:  # Ray raises bare Exceptions for start-up time-outs
            # Stop what half-started (a GCS, a raylet and its agents stay up otherwise, and
            # load the machine further) before the next try.
            ray.shutdown()
            ray_reaper.kill_all(ray_reaper.descendants(os.getpid()) - before)
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if address:
                raise PreflightError(
                    f"could not join the Ray cluster at {address}: {first_line}"
                ) from err
            if attempt == attempts:
                raise PreflightError(
                    f"could not start a local Ray in {attempts} attempts ({first_line}); "
                    f"{_load_note()}; or start Ray yourself (ray start --head) and pass "
                    "--external-ray"
                ) from err
            log.warning(
                "Ray start-up failed (%s); trying again (%d/%d)", first_line, attempt, attempts
            )
            time.sleep(retry_wait_s * attempt)
    if not address:
        _start_reaper()
    if plain_logs() and log_to_driver:
        route_worker_lines()
    log.info("Ray resources: %s", ray.cluster_resources())


def _load_note() -> str:
    """The machine's measured load, and the advice that fits it."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    measured = f"load average {load:.1f} on {cores} cores"
    if load > cores:
        return f"the machine is busy ({measured}): retry later or with fewer --ray-num-cpus"
    return f"the machine is not busy ({measured}): see Ray's logs under /tmp/ray/session_latest"


_reaper: subprocess.Popen | None = None


def _start_reaper() -> None:
    """The local Ray's reaper: a small process that waits for this one to close its pipe."""
    global _reaper
    import ray

    _stop_reaper()
    try:  # Ray has no public name for the session folder
        session_dir = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:
        log.warning("no Ray session folder found: a killed driver may leave Ray processes")
        return
    _reaper = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("ray_reaper.py")),
            session_dir,
            str(os.getpid()),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a kill of this process group spares it
    )


def _stop_reaper() -> None:
    """Close the pipe: the reaper removes whatever the session left, then exits."""
    global _reaper
    if _reaper is not None:
        _reaper.stdin.close()
        try:
            _reaper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("the Ray reaper (pid %d) is still running", _reaper.pid)
        _reaper = None


def shutdown_ray() -> None:
    """`ray.shutdown()`, then let the reaper remove what is left of a local Ray."""
    import ray

    ray.shutdown()
    _stop_reaper()


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


#: how much of a node's custom resource one bundle asks for (a node offering 1 holds 1000)
NODE_RESOURCE_SLIVER = 0.001


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
    trainer_resource: str | None = None,
    engine_resource: str | None = None,
) -> Placement:
    """Reserve the bundles for `num_trainers` ranks and `num_engines` engines.

    Colocated: max(trainers, engines) bundles, shared. Separate: trainers + engines bundles.
    On a GPU cluster each bundle is {GPU: 1, CPU: cpus_per_bundle}; on CPU {CPU: cpus_per_bundle}
    (keep it fractional so other work still finds a CPU). `trainer_resource` /
    `engine_resource` name a custom resource (`ray start --resources='{"NAME": 1}'`) that the
    trainer's / the engines' bundles ask a sliver of, so they go only to the nodes that have it.
    Bundles that the cluster cannot hold are refused at once (`check_fits`).
    """
    import ray
    from ray.util.placement_group import placement_group

    if gpus_per_engine < 1:
        raise ValueError(f"gpus_per_engine must be >= 1, got {gpus_per_engine}")
    per_engine = gpus_per_engine if use_gpu else 1
    bundle: dict[str, float] = {"CPU": cpus_per_bundle}
    if use_gpu:
        bundle["GPU"] = 1.0
    trainer_tag = {trainer_resource: NODE_RESOURCE_SLIVER} if trainer_resource else {}
    engine_tag = {engine_resource: NODE_RESOURCE_SLIVER} if engine_resource else {}
    if colocate:
        n = max(num_trainers, num_engines * per_engine)
        trainer_bundles = list(range(num_trainers))
        engine_bundles = [e * per_engine for e in range(num_engines)]
        bundles = [
            {**bundle, **(trainer_tag if b < num_trainers else {}), **engine_tag} for b in range(n)
        ]
    else:
        n = num_trainers + num_engines
        trainer_bundles = list(range(num_trainers))
        engine_bundles = list(range(num_trainers, n))
        engine_bundle = {**bundle, "GPU": float(per_engine)} if use_gpu else bundle
        bundles = [{**bundle, **trainer_tag} for _ in trainer_bundles] + [
            {**engine_bundle, **engine_tag} for _ in engine_bundles
        ]
    check_fits(bundles, nodes())
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
