"""The Ray side of a run: `ClusterConfig` (how many GPUs, shared or split, which Ray), the
`Layout` of trainer ranks and engines it gives, and `Cluster`, which starts Ray, reserves the
placement group and builds the actor groups in it, and shuts down what it started."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_runtime.actor_group import RolloutGroup, TrainGroup
from rl_runtime.config_fields import ConfigError, option
from rl_runtime.placement import Placement, create_placement, init_ray, shutdown_ray
from rl_runtime.placement_plan import actor_nodes, format_plan, plan_rows
from rl_runtime.preflight import PreflightError
from rl_runtime.protocols import TrainerConfig
from weight_sync import TransportFactory

log = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    """The machines a run asks for."""

    num_gpus: int = option(8, "GPUs to use (0: CPU run)", ge=0)
    colocate: bool = option(True, "trainer and rollout share the GPUs (offload between phases)")
    rollout_num_gpus: int | None = option(
        None, "separate mode: GPUs for rollout engines (default: half of --num-gpus)", ge=1
    )
    cpu_trainers: int = option(1, "CPU run: trainer ranks (gloo)", ge=1)
    cpu_engines: int = option(1, "CPU run: rollout engines", ge=1)
    external_ray: bool = option(False, "connect to a running Ray cluster (address 'auto')")
    ray_address: str | None = option(None, "Ray cluster address (implies an external cluster)")
    ray_num_cpus: int | None = option(None, "CPUs of the local Ray (default: all)", ge=1)
    trainer_resource: str | None = option(
        None, "cluster: only nodes with this custom Ray resource hold trainer ranks"
    )
    rollout_resource: str | None = option(
        None, "cluster: only nodes with this custom Ray resource hold rollout engines"
    )
    node_wait_s: float = option(
        60.0,
        "a restarted engine waits this long for a live node to hold it (a lost node's), "
        "then the run stops",
        ge=0,
    )

    def check(self) -> None:
        rollout = self.rollout_num_gpus or max(1, self.num_gpus // 2)
        if self.num_gpus and not self.colocate and rollout >= self.num_gpus:
            raise ConfigError(
                f"--no-colocate --rollout-num-gpus {rollout} leaves no GPU for training "
                f"(--num-gpus {self.num_gpus})"
            )

    @property
    def use_gpu(self) -> bool:
        return self.num_gpus > 0


@dataclass
class Layout:
    """How many trainer ranks and engines, and whether they share devices."""

    num_trainers: int
    num_engines: int
    colocate: bool
    use_gpu: bool
    gpus_per_engine: int = 1  # SGLang tensor parallel: each engine's GPUs

    @property
    def actor_cpus(self) -> float:
        """CPUs each actor asks for inside its bundle (two actors share a colocated bundle)."""
        return self.bundle_cpus / 2 if self.colocate else self.bundle_cpus

    @property
    def bundle_cpus(self) -> float:
        return 2.0 if self.use_gpu else 0.5


def layout(cfg: ClusterConfig, *, with_engines: bool = True, gpus_per_engine: int = 1) -> Layout:
    """The ranks and engines of `cfg` (an SFT run has no engines; an engine of N GPUs takes N
    of the rollout GPUs)."""
    if cfg.num_gpus <= 0:
        engines = cfg.cpu_engines if with_engines else 0
        return Layout(cfg.cpu_trainers, engines, cfg.colocate, False)
    if cfg.colocate or not with_engines:
        lay = Layout(cfg.num_gpus, cfg.num_gpus if with_engines else 0, True, True)
    else:
        rollout = cfg.rollout_num_gpus or max(1, cfg.num_gpus // 2)
        if rollout >= cfg.num_gpus:
            raise ConfigError(
                f"--rollout-num-gpus {rollout} leaves no GPU for training (--num-gpus {cfg.num_gpus})"
            )
        lay = Layout(cfg.num_gpus - rollout, rollout, False, True)
    if gpus_per_engine == 1 or not with_engines:
        return lay
    if lay.num_engines % gpus_per_engine:
        raise PreflightError(
            f"--rollout-num-gpus-per-engine {gpus_per_engine} does not divide the "
            f"{lay.num_engines} rollout GPUs"
        )
    return dataclasses.replace(
        lay, num_engines=lay.num_engines // gpus_per_engine, gpus_per_engine=gpus_per_engine
    )


def placement_preview(cfg: ClusterConfig, lay: Layout) -> list[dict[str, Any]] | None:
    """For ``--print-config`` on a cluster (``--ray-address`` / ``--external-ray``): join it,
    reserve the run's placement group, read which node holds each actor (`Cluster.plan`),
    and give it all back; no actor starts and no model loads. None without a cluster."""
    if not (cfg.ray_address or cfg.external_ray):
        return None
    with Cluster(cfg, lay) as cluster:
        return cluster.plan()


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
        address = self.cfg.ray_address or ("auto" if self.cfg.external_ray else None)
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
        self, trainer: TrainerConfig, *, tp_size: int = 1, wait: bool = True
    ) -> TrainGroup:
        """The trainer ranks, each building `trainer` in its actor; a pipeline-parallel
        trainer config (`pp`, Megatron) sets the ranks' order with `tp_size`. ``wait=False``:
        the ranks build while the caller goes on (start the engines, then `group.ready()`)."""
        group = TrainGroup(
            trainer.build,
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
        for group in self.groups:
            try:
                group.shutdown()
            except Exception:  # shutting down is best effort
                log.debug("group shutdown failed", exc_info=True)
        self.groups = []
        self.placement.remove()
        if self.owns_ray:
            shutdown_ray()
