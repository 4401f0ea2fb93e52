"""The Ray side of a run: `Cluster`, which starts Ray, reserves the placement group for a
`Layout` (`rl_runtime.cluster_config`, with the `ClusterConfig` that gives it) and builds the
actor groups in it, and shuts down what it started."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_runtime.actor_group import RolloutGroup, TrainGroup
from rl_runtime.cluster_config import ClusterConfig, Layout
from rl_runtime.interrupts import shielded
from rl_runtime.placement import Placement, create_placement, init_ray, shutdown_ray
from rl_runtime.placement_plan import actor_nodes, format_plan, plan_rows
from rl_runtime.progress import phase
from rl_runtime.protocols import ActorClass, TrainActor, TrainerConfig
from weight_sync import TransportFactory

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    """Ray (started here, or joined), one placement group for `layout`, and the groups built in
    it; `close()` shuts the groups down, frees the placement and stops a Ray it started."""

    cfg: ClusterConfig
    layout: Layout
    placement: Placement = field(init=False)
    owns_ray: bool = field(init=False)
    groups: list[Any] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        import ray

        self.owns_ray = not ray.is_initialized()
        address = self.cfg.ray_to_join
        label = "Ray start" if address is None else f"Ray: joining the cluster at {address}"
        with phase(label) if self.owns_ray else contextlib.nullcontext():
            init_ray(address, num_cpus=self.cfg.ray_num_cpus)
        lay = self.layout
        self.placement = create_placement(
            num_trainers=lay.num_trainers,
            num_engines=lay.num_engines,
            colocate=lay.colocate,
            use_gpu=lay.use_gpu,
            cpus_per_bundle=lay.bundle_cpus,
            gpus_per_engine=lay.gpus_per_engine,
            trainer_resource=self.cfg.trainer_resource,
            engine_resource=self.cfg.rollout_resource,
        )
        log.info("placement plan:\n%s", format_plan(self.plan()))

    def plan(self) -> list[dict[str, Any]]:
        """Which node each trainer rank and engine is placed on (`placement_plan.plan_rows`)."""
        cpus = self.layout.actor_cpus
        return plan_rows(self.placement, trainer_cpus=cpus, engine_cpus=cpus)

    def record(self, run_dir: Path) -> None:
        """Write ``placement.json`` into `run_dir`: the plan and where each actor runs."""
        run_dir.mkdir(parents=True, exist_ok=True)
        placed = {"plan": self.plan(), "actors": self.where()}
        (run_dir / "placement.json").write_text(json.dumps(placed, indent=2) + "\n")

    def where(self) -> dict[str, list[str]]:
        """The node id each built actor runs on, as the actors report it, by group kind."""
        out: dict[str, list[str]] = {}
        for group in self.groups:
            kind = "trainer" if isinstance(group, TrainGroup) else "engine"
            out.setdefault(kind, []).extend(actor_nodes(group.workers))
        return out

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def train_group(
        self,
        trainer: TrainerConfig,
        actor_class: ActorClass,
        *,
        tp_size: int = 1,
        wait: bool = True,
    ) -> TrainGroup:
        """The trainer ranks, each building ``actor_class()(trainer)`` in its actor; a
        pipeline-parallel trainer config (`pp`, Megatron) sets the ranks' order with `tp_size`.
        ``wait=False``: the ranks build while the caller goes on (start the engines, then
        `group.ready()`)."""
        group = TrainGroup(
            functools.partial(build_actor, actor_class, trainer),
            world_size=self.layout.num_trainers,
            placement=self.placement,
            num_cpus=self.layout.actor_cpus,
            tp_size=tp_size,
            pp_size=int(getattr(trainer, "pp", 1)),
            wait=wait,
        )
        self.groups.append(group)
        return group

    def rollout_group(
        self,
        factory: Callable[[], Any],
        *,
        request_fn: Callable[[Any], Any],
        params_fn: Callable[..., Any],
        transport: TransportFactory | None = None,
    ) -> RolloutGroup:
        """The rollout engines, each built by `factory()` in its actor."""
        group = RolloutGroup(
            factory,
            num_engines=self.layout.num_engines,
            placement=self.placement,
            request_fn=request_fn,
            params_fn=params_fn,
            num_cpus=self.layout.actor_cpus,
            transport=transport,
            node_wait_s=self.cfg.node_wait_s,
        )
        self.groups.append(group)
        return group

    def close(self) -> None:
        """Shut the groups down, free the placement, stop a Ray started here; a second Ctrl-C
        does not cut it short (`rl_runtime.interrupts.shielded`)."""
        with shielded():
            for group in self.groups:
                try:
                    group.shutdown()
                except Exception:  # shutting down is best effort
                    log.debug("group shutdown failed", exc_info=True)
            self.groups = []
            self.placement.remove()
            if self.owns_ray:
                shutdown_ray()


def build_actor(actor_class: ActorClass, trainer: TrainerConfig) -> TrainActor:
    """One trainer rank's actor, in that rank's process: its class imported there (the driver
    never loads the backend), built from `trainer`."""
    return actor_class()(trainer)


def placement_preview(cfg: ClusterConfig, lay: Layout) -> list[dict[str, Any]]:
    """For ``--print-config`` on a cluster (``ClusterConfig.ray_to_join``): join it, reserve
    the run's placement group, read which node holds each actor (`Cluster.plan`), and give it
    all back; no actor starts and no model loads."""
    with Cluster(cfg, lay) as cluster:
        return cluster.plan()
