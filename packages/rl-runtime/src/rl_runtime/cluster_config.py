"""What a run asks of the machines, as plain data without Ray: `ClusterConfig` (how many GPUs,
shared or split, which Ray) and the `Layout` of trainer ranks and engines it gives. A launcher
parses and checks them before Ray loads; `rl_runtime.cluster.Cluster` starts what they say
(and `rl_runtime.cluster.placement_preview` shows it): this module imports nothing of Ray."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_runtime.config_fields import ConfigError, option
from rl_runtime.preflight import PreflightError


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

    @property
    def ray_to_join(self) -> str | None:
        """The address of the Ray cluster the run joins (``auto``: the one running on this
        machine); None: the run starts a Ray of its own."""
        return self.ray_address or ("auto" if self.external_ray else None)


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
