"""Ray actor groups: the trainer ranks (`TrainGroup`) and the rollout engines (`RolloutGroup`).

Each group is a handful of Ray actors with explicit methods (no generated attributes), driven
from the loop in the driver process: it starts them in the placement, splits each call's batch
or prompts over them, and says which one died and where. What runs inside each actor is
`rl_runtime.workers` (`TrainWorker`, `EngineWorker`). The concrete trainer / engine is built
inside its actor by a picklable factory the app passes in, so this module knows only the
protocols.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from rl_runtime.faults import RunStopped, WorkerDied, gather
from rl_runtime.placement import Placement
from rl_runtime.placement_plan import actor_nodes, bundle_node
from rl_runtime.placement_plan import nodes as cluster_nodes
from rl_runtime.progress import heartbeat
from rl_runtime.workers import EngineWorker, TrainWorker, probe_address
from weight_sync import TransportFactory
from weight_sync.object_store import object_store

log = logging.getLogger(__name__)


#: Times a trainer group starts its ranks again when rank 0 could not bind the rendezvous
#: port: it is chosen free (:func:`rl_runtime.workers.probe_address`) but released until rank 0's TCPStore binds it,
#: and another process may take it in between (seen once in the suite, with several groups
#: starting side by side).
PORT_RETRIES = 3


def _port_taken(err: BaseException) -> bool:
    """Whether a rank's start failed because its rendezvous port was in use."""
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _unreachable(err: BaseException) -> bool:
    """An actor Ray could not reach (a lost node looks so until Ray marks the node dead)."""
    return "ActorUnavailableError" in str(err)


def _lost_note(nodes: Sequence[str], wait_s: float = 0.0) -> str:
    """ "its node ... was lost" for those of `nodes` Ray reports dead (waiting up to `wait_s`
    for it to notice one), or ""."""
    deadline = time.monotonic() + wait_s
    while True:
        lost = sorted(set(nodes) - set(cluster_nodes()))
        if lost:
            return f"its node {', '.join(n[:8] for n in lost)} was lost"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(1.0)


#: How long to wait, after an actor became unreachable, for Ray to tell whether its node died.
NODE_LOSS_S = 30.0
#: seconds between the notes of a trainer group that is still starting
STARTUP_NOTE_S = 60.0
POLL_S = 5.0


def data_rank(rank: int, tp: int, dp: int) -> int:
    """The data-parallel rank of global ``rank`` in Megatron's order (TP fastest, then DP, then
    pipeline stages); with TP = PP = 1 the rank itself."""
    return (rank // tp) % dp


def _split(items: Sequence[Any], parts: int) -> list[list[int]]:
    """Contiguous, near-equal index ranges (the order of results stays the order of items)."""
    n = len(items)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


class TrainGroup:
    """The trainer ranks. Each call goes to every rank with that rank's share of the batch."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        world_size: int,
        placement: Placement,
        num_cpus: float = 0.25,
        tp_size: int = 1,
        pp_size: int = 1,
        log_level: str = "WARNING",
        gc_every: int = 50,
        wait: bool = True,
    ) -> None:
        """``gc_every``: each rank collects Python's garbage every that many train steps, with
        automatic collection off (:class:`rl_runtime.gc_policy.PeriodicGC`); 0 leaves it on.
        ``tp_size`` / ``pp_size``: ranks per model replica, in Megatron's rank order (TP
        fastest, then data parallel, then pipeline stages). ``wait=False`` returns while the
        ranks still build their models (the engines can start meanwhile); `ready()` waits."""
        if world_size % (tp_size * pp_size):
            raise ValueError(
                f"world size {world_size} is not a multiple of TP x PP = {tp_size * pp_size}"
            )
        self.world_size = world_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.workers: list[Any] = []
        self.nodes: list[str] = []  # each rank's node id, once ready
        self.last_push_bytes: int | None = None  # of the last push_weights
        self._started = time.perf_counter()
        self._spawn_args = (factory, placement, num_cpus, log_level, gc_every)
        self._starting: list[Any] | None = self._spawn()
        if wait:
            self.ready()

    def _spawn(self) -> list[Any]:
        """Start every rank (rank 0 on a freshly chosen rendezvous port); returns the calls
        that answer once each rank has built its trainer."""
        factory, placement, num_cpus, log_level, gc_every = self._spawn_args
        remote_cls = ray.remote(TrainWorker)
        master: tuple[str, int] | None = None
        self.workers = []
        for rank in range(self.world_size):
            opts = {
                "num_cpus": num_cpus,
                "num_gpus": placement.trainer_gpus,
                "scheduling_strategy": placement.strategy(placement.trainer_bundles[rank]),
            }
            if rank == 0 and self.world_size > 1:
                # Rank 0 picks the rendezvous address on its own node; the others join it.
                probe = ray.remote(probe_address).options(**opts)
                master = ray.get(probe.remote())
            addr, port = master if master else (None, None)
            self.workers.append(
                remote_cls.options(**opts).remote(
                    rank, self.world_size, addr, port, factory, log_level, gc_every
                )
            )
        return [w.address.remote() for w in self.workers]

    def ready(self) -> None:
        """Wait until every rank has built its trainer; a construction error surfaces here."""
        if self._starting is None:
            return
        futures, self._starting = self._starting, None

        def still_starting(seconds: float, ranks: list[str]) -> None:
            log.warning(
                "trainer group: %s still starting after %.0f s (the last start-up phase each "
                "rank logged is where it is)",
                ", ".join(ranks),
                seconds,
            )

        names = [f"trainer rank {r}" for r in range(len(futures))]
        for attempt in range(PORT_RETRIES + 1):
            try:
                gather(
                    futures, names, "start", still_waiting=still_starting, every_s=STARTUP_NOTE_S
                )
                break
            except Exception as err:
                if attempt == PORT_RETRIES or not _port_taken(err):
                    raise
                log.warning(
                    "trainer group: the rendezvous port was taken before rank 0 bound it "
                    "(another process chose it meanwhile); starting the ranks again on another "
                    "port (%d/%d)",
                    attempt + 1,
                    PORT_RETRIES,
                )
                self.shutdown()
                futures = self._spawn()
        self.nodes = actor_nodes(self.workers)  # where each rank runs (a lost node is named)
        seconds = time.perf_counter() - self._started
        log.info("trainer group: %d rank(s) ready in %.1f s", self.world_size, seconds)

    def _call(self, method: str, *args_per_rank: Sequence[Any], **kwargs: Any) -> list[Any]:
        """`method` on every rank (rank r gets `args[r]` of each list), results in rank order;
        a rank that dies stops the call at once with its number (:func:`faults.gather`)."""
        futures = [
            getattr(w, method).remote(*(a[r] for a in args_per_rank), **kwargs)
            for r, w in enumerate(self.workers)
        ]
        names = [f"trainer rank {r}" for r in range(len(self.workers))]
        try:
            return gather(futures, names, method)
        except WorkerDied as err:
            lost = _lost_note(self.nodes, wait_s=NODE_LOSS_S if _unreachable(err) else 0.0)
            if lost:  # the line says why the rank died
                err.args = (f"{err}: {lost}",)
            raise

    def _shard(self, batch: Any) -> list[Any]:
        """One shard per data-parallel rank, repeated over the ranks of its model replica."""
        if self.world_size == 1:
            return [batch]
        dp = self.world_size // (self.tp_size * self.pp_size)
        parts = [batch.select(idx) for idx in _split(range(len(batch)), dp)]
        return [parts[data_rank(r, self.tp_size, dp)] for r in range(self.world_size)]

    def compute_logprobs(self, batch: Any, *, reference: bool = False) -> list[Any]:
        outs = self._call("compute_logprobs", self._shard(batch), reference=reference)
        # the first rank of each replica (first stage, TP rank 0) speaks for its shard
        dp = self.world_size // (self.tp_size * self.pp_size)
        return [lp for out in outs[: dp * self.tp_size : self.tp_size] for lp in out]

    def train_step(self, batch: Any, *, loss: str = "grpo") -> dict[str, float]:
        return self._call("train_step", self._shard(batch), loss=loss)[0]

    def save_checkpoint(self, path: str | Path) -> None:
        self._call("save_checkpoint", [str(path)] * len(self.workers))

    def load_checkpoint(self, path: str | Path) -> None:
        self._call("load_checkpoint", [str(path)] * len(self.workers))

    def export_hf(self, path: str | Path) -> None:
        self._call("export_hf", [str(path)] * len(self.workers))

    def offload(self) -> dict[str, float]:
        """Every rank's state to the host; rank 0's copy metrics (each rank has its own link)."""
        return self._call("offload")[0] or {}

    def onload(self) -> dict[str, float]:
        """Every rank's state back; rank 0's copy metrics."""
        return self._call("onload")[0] or {}

    def release_cache(self) -> None:
        self._call("release_cache")

    def push_weights(self, rollout: RolloutGroup, bucket_bytes: int = 256 << 20) -> int:
        """Send the current weights to every engine, through the rollout group's transport
        (`rl_runtime.protocols.TransportFactory`; Ray's object store unless the app chose
        another: CUDA IPC when colocated on GPUs, NCCL for engines on GPUs of their own).
        Returns the number of tensors sent; their bytes are kept as `last_push_bytes` (the
        loop's ``perf/sync_gbps``)."""
        n = len(self.workers)
        args = [rollout.workers] * n, [bucket_bytes] * n, [rollout.transport] * n
        sent, self.last_push_bytes = self._call("push_weights", *args)[0]
        return sent

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []


class RolloutGroup:
    """The rollout engines. Prompts are split in contiguous chunks, one per engine."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        num_engines: int,
        placement: Placement,
        request_fn: Callable[[Any], Any],
        params_fn: Callable[..., Any],
        num_cpus: float = 0.25,
        transport: TransportFactory | None = None,
        log_level: str = "WARNING",
        node_wait_s: float = 60.0,
    ) -> None:
        """``transport``: how trainer rank 0 sends weights to these engines (default: Ray's
        object store). ``node_wait_s``: how long a restarted engine's bundle may be on no live
        node before :meth:`restart` stops the run."""
        self.transport: TransportFactory = object_store if transport is None else transport
        remote_cls = ray.remote(EngineWorker)
        devices = placement.engine_devices

        def spawn(i: int) -> Any:
            return remote_cls.options(
                num_cpus=num_cpus,
                num_gpus=placement.engine_gpus,
                scheduling_strategy=placement.strategy(placement.engine_bundles[i]),
            ).remote(
                factory,
                request_fn,
                params_fn,
                log_level,
                ",".join(devices[i]) if devices else None,
            )

        self._spawn = spawn
        self._placement = placement
        self._node_wait_s = node_wait_s
        self._unplaced_engines: set[int] = set()  # killed: no node could hold them
        start = time.perf_counter()
        with heartbeat("rollout engines' start"):
            self.workers = [spawn(i) for i in range(num_engines)]
            self._call("health")
        self.nodes = actor_nodes(self.workers)  # where each engine runs (a lost node is named)
        seconds = time.perf_counter() - start
        log.info("rollout group: %d engine(s) ready in %.1f s", num_engines, seconds)

    def _call(self, method: str, *args: Any) -> list[Any]:
        futures = [getattr(w, method).remote(*args) for w in self.workers]
        return gather(futures, self._names(), method)

    def _names(self) -> list[str]:
        return [f"rollout engine {i}" for i in range(len(self.workers))]

    def dead_engines(self, timeout_s: float = 60.0) -> list[int]:
        """Which engines' actors are gone (their ``health`` call raises Ray's actor error, or
        its memory monitor's for an engine it killed)."""
        futures = [w.health.remote() for w in self.workers]
        dead = []
        for i, ref in enumerate(futures):
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError):
                dead.append(i)
        return dead

    def restart(self, indices: Sequence[int]) -> None:
        """Replace the engines at `indices` (dead ones) by fresh actors in the same bundles.
        They start from the model the factory builds: push the current weights next.

        When an engine's node was lost, Ray moves its bundle to a node that can hold it, if
        any: a replacement that Ray placed on the old node before it saw the node go (it dies
        at once) is replaced once more, and one whose bundle no live node holds for
        `node_wait_s` stops the run, naming the node. A placed engine may take as long as its
        model takes to load."""
        for attempt in range(2):
            for i in indices:
                ray.kill(self.workers[i], no_restart=True)
                self.workers[i] = self._spawn(i)
            refs = [self.workers[i].health.remote() for i in indices]
            try:
                self._wait_placed(indices, refs, self._node_wait_s)
            except RunStopped:
                # never placed: killed here, or shutdown() would wait for them to answer
                for i in indices:
                    ray.kill(self.workers[i], no_restart=True)
                self._unplaced_engines.update(indices)
                raise
            try:
                gather(refs, [self._names()[i] for i in indices], "restart")
                break
            except RunStopped as err:
                lost = _lost_note([self.nodes[i] for i in indices])
                if not lost or attempt == 1:
                    raise RunStopped(f"{err}: {lost}" if lost else str(err)) from err
                log.warning("%s (%s); placing it again", err, lost)
        for i in indices:
            self.nodes[i] = actor_nodes([self.workers[i]])[0]
        log.info("rollout engine(s) %s restarted", list(indices))

    def _wait_placed(self, indices: Sequence[int], refs: list[Any], unplaced_s: float) -> None:
        """Until every call in `refs` has an answer; raise once a bundle of `indices` has
        been on no live node for `unplaced_s`."""
        bundles = [self._placement.engine_bundles[i] for i in indices]
        since: float | None = None
        while len(ray.wait(refs, num_returns=len(refs), timeout=POLL_S)[0]) < len(refs):
            alive = cluster_nodes()
            if all(bundle_node(self._placement.pg, b) in alive for b in bundles):
                since = None
                continue
            since = since if since is not None else time.monotonic()
            if time.monotonic() - since > unplaced_s:
                raise RunStopped(self._unplaced(indices, unplaced_s))

    def _unplaced(self, indices: Sequence[int], waited_s: float) -> str:
        what = ", ".join(self._names()[i] for i in indices)
        spec = self._placement.pg.bundle_specs[self._placement.engine_bundles[indices[0]]]
        cause = _lost_note([self.nodes[i] for i in indices]) or "Ray did not place it"
        return (
            f"{what} could not be restarted: {cause}, and for {waited_s:.0f} s no live node "
            f"held its bundle {spec}"
        )

    def generate(
        self,
        prompts: Sequence[Any],
        *,
        n: int,
        on_ready: Callable[[list[int], list[list[Any]]], None] | None = None,
        **sampling: Any,
    ) -> list[list[Any]]:
        """`n` completions for each prompt, grouped per prompt, in prompt order. A `seed` in
        `sampling` is offset per engine so that engines do not repeat each other.

        ``on_ready(prompt_indices, groups)`` receives each engine's groups as soon as they
        arrive while other engines still generate (the loop scores them meanwhile); the
        returned list holds the same group lists."""
        chunks = _split(prompts, len(self.workers))
        futures = []
        for i, (w, idx) in enumerate(zip(self.workers, chunks, strict=True)):
            params = dict(sampling)
            if params.get("seed") is not None:
                params["seed"] = int(params["seed"]) + 1000003 * i
            futures.append(w.generate.remote([prompts[j] for j in idx], n, params))
        groups: list[list[Any]] = [[] for _ in prompts]
        placed: set[int] = set()

        def place(i: int, out: list[Any]) -> list[list[Any]]:
            mine = [out[k * n : (k + 1) * n] for k in range(len(chunks[i]))]
            for j, group in zip(chunks[i], mine, strict=True):
                groups[j] = group
            placed.add(i)
            return mine

        def ready(i: int, out: list[Any]) -> None:
            mine = place(i, out)
            if on_ready is not None:
                on_ready(list(chunks[i]), mine)

        outs = gather(futures, self._names(), "generate", while_waiting=ready)
        for i, out in enumerate(outs):
            if i not in placed:
                place(i, out)
        return groups

    def engine_stats(self) -> dict[str, float]:
        """The engines' own account of the last generate (HFEngine: prefill, decode and
        graph-capture time): counts summed over engines, seconds (``*_s``, ``seconds``) their
        maximum, since engines run side by side. Empty where no engine keeps one."""
        out: dict[str, float] = {}
        for stats in self._call("stats"):
            for k, v in stats.items():
                timed = k.endswith("_s") or k == "seconds"
                out[k] = max(out.get(k, 0.0), v) if timed else out.get(k, 0.0) + v
        return out

    @property
    def engines_restartable(self) -> bool:
        """Whether a dead engine can be replaced: its transport can reach a new one."""
        return bool(self.transport.restartable)

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """The engines' memory back: all of it, or the parts ``tags`` name (``WEIGHTS``,
        ``KV_CACHE``)."""
        self._call("resume_memory", tags)

    def shutdown(self) -> None:
        for i, w in enumerate(self.workers):
            if i in self._unplaced_engines:
                continue
            try:
                ray.get(w.shutdown.remote(), timeout=30)
            except Exception:  # an engine that is already gone needs no shutdown
                log.debug("engine shutdown failed", exc_info=True)
            ray.kill(w)
        self.workers = []
