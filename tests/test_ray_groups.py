"""Ray actor groups with the real trainer and engine: weight sync through the transport
protocol, by each transport.

Trainer rank 0 builds the transport the rollout group names (`weight_sync.TransportFactory`)
and feeds it the actor's buckets. Ray's object store is rl-runtime's default. The CUDA IPC
transport runs here on CPU buffers (they travel by value; only the handle exchange needs a
GPU). The disk transport writes safetensors files the engine reads back. The NCCL transport is
what separate mode uses between trainer rank 0 and SGLang engines;
here the receiving side is a small gloo receiver in front of the transformers engine, so the
same sender, group set-up and Ray plumbing run on a CPU.
"""

from __future__ import annotations

import functools
import sys

import pytest
import ray
import torch

from rl_runtime import RolloutGroup, TrainGroup, create_placement, init_ray

# Real processes on 2 shared cores: allow more than the suite-wide 300 s per test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class GlooReceiver:
    """The engine side of `weight_sync.DistributedWeightSender`, for the HF engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.group = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def init_weights_update_group(
        self, *, master_address, master_port, rank_offset, world_size, group_name, backend
    ):
        from weight_sync.nccl import init_weight_sync_group

        self.group = init_weight_sync_group(
            backend=backend,
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank=rank_offset,
            group_name=group_name,
        )
        return True, "ok"

    def update_weights_from_distributed(self, *, names, dtypes, shapes, group_name, flush_cache):
        import torch.distributed as dist

        bucket = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=self.group)
            bucket.append((name, t))
        self.engine.update_weights([bucket])
        return True, "ok"


def _tiny_source():
    from vlm_data.processor import tiny_processor
    from vlm_models.presets import tiny_config

    proc = tiny_processor()
    tok = proc.tokenizer
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    cfg = tiny_config(
        vocab_size=len(tok),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return proc, cfg


def make_trainer(cfg):
    from trainers_fsdp import FsdpConfig
    from trainers_fsdp.actor import FsdpActor

    return FsdpActor(FsdpConfig(model=cfg, device="cpu", attn_implementation="sdpa", seed=0))


def make_engine(cfg, seed, eos, gloo):
    from rollout_sglang.hf.engine import HFEngine
    from vlm_models.build import build_model

    torch.manual_seed(seed)
    engine = HFEngine(build_model(cfg), device="cpu", eos_token_ids=eos, max_batch_size=8)
    return GlooReceiver(engine) if gloo else engine


@pytest.fixture(scope="module")
def ray_local():
    init_ray(num_cpus=2)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def test_every_transport_gives_the_same_engine(ray_local, tmp_path):
    from rollout_sglang.types import GenerateRequest, SamplingParams
    from vlm_data.prompts import PromptBuilder
    from vlm_data.synthetic import make_synthetic_rows
    from weight_sync.cuda_ipc import CudaIpc
    from weight_sync.disk import Disk
    from weight_sync.nccl import Nccl

    proc, cfg = _tiny_source()
    eos = [proc.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    placement = create_placement(
        num_trainers=1, num_engines=4, colocate=False, use_gpu=False, cpus_per_bundle=0.25
    )
    groups = []
    try:
        train = TrainGroup(  # it starts while the engines start (ready() below)
            functools.partial(make_trainer, cfg),
            world_size=1,
            placement=placement,
            num_cpus=0.25,
            wait=False,
        )
        groups.append(train)
        kw = dict(
            placement=placement,
            request_fn=GenerateRequest.from_prompt,
            params_fn=SamplingParams,
            num_cpus=0.25,
        )
        # Four single-engine groups on the engine bundles, random inits that differ.
        placement.engine_bundles = [1]
        plain = RolloutGroup(
            functools.partial(make_engine, cfg, 1, eos, False), num_engines=1, **kw
        )
        groups.append(plain)
        placement.engine_bundles = [2]
        dist_group = RolloutGroup(
            functools.partial(make_engine, cfg, 2, eos, True),
            num_engines=1,
            transport=Nccl(backend="gloo"),
            **kw,
        )
        groups.append(dist_group)
        placement.engine_bundles = [3]
        ipc_group = RolloutGroup(
            functools.partial(make_engine, cfg, 3, eos, False),
            num_engines=1,
            transport=CudaIpc(),
            **kw,
        )
        groups.append(ipc_group)
        placement.engine_bundles = [4]
        disk_group = RolloutGroup(
            functools.partial(make_engine, cfg, 4, eos, False),
            num_engines=1,
            transport=Disk(str(tmp_path / "weight-sync")),
            **kw,
        )
        groups.append(disk_group)
        train.ready()
        assert not dist_group.engines_restartable and ipc_group.engines_restartable
        builder = PromptBuilder(proc)
        prompts = [builder.build(r, i) for i, r in enumerate(make_synthetic_rows(3, task="color"))]
        greedy = dict(n=1, temperature=0.0, max_new_tokens=6, seed=0)

        def outputs(group):
            comps = [c for g in group.generate(prompts, **greedy) for c in g]
            return [c.token_ids for c in comps], torch.tensor(
                [lp for c in comps for lp in c.logprobs]
            )

        ids_a, lp_a = outputs(plain)
        stats = plain.engine_stats()  # the HFEngine's account of that generate
        assert stats["requests"] == 3 and stats["decode_steps"] >= 1 and stats["prefills"] >= 1
        assert 0 < stats["prefill_s"] + stats["decode_s"] <= stats["seconds"]
        ids_b, lp_b = outputs(dist_group)
        ids_c, lp_c = outputs(ipc_group)
        ids_d, lp_d = outputs(disk_group)
        assert lp_a.shape != lp_b.shape or not torch.allclose(lp_a, lp_b)  # different weights
        assert lp_a.shape != lp_c.shape or not torch.allclose(lp_a, lp_c)
        assert lp_a.shape != lp_d.shape or not torch.allclose(lp_a, lp_d)
        sent = train.push_weights(plain)
        assert sent > 0
        pushed = train.last_push_bytes  # the loop's perf/sync_gbps counts them
        assert pushed and pushed > 2 * sent  # no tensor of one byte
        assert train.push_weights(dist_group) == sent
        assert train.push_weights(ipc_group) == sent
        assert train.push_weights(disk_group) == sent
        assert sorted(p.name for p in (tmp_path / "weight-sync").iterdir())[-1] == "manifest.json"
        ids_a, lp_a = outputs(plain)
        ids_b, lp_b = outputs(dist_group)
        ids_c, lp_c = outputs(ipc_group)
        ids_d, lp_d = outputs(disk_group)
        assert ids_a == ids_b == ids_c == ids_d
        torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-6)
        torch.testing.assert_close(lp_a, lp_c, rtol=0, atol=1e-6)
        torch.testing.assert_close(lp_a, lp_d, rtol=0, atol=1e-6)
        assert train.push_weights(dist_group) == sent  # the group is set up once, reused
    finally:
        for g in groups:
            g.shutdown()
        placement.remove()


class SlowEngine:
    """An engine that answers each request with its prompt id, taking ``delay`` s when it is
    given prompt 0: which engine is slow follows from the prompts it is sent, not from the
    order in which Ray happens to start the actors."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def generate(self, requests, params):
        import time

        slow = 0 in requests
        if slow:
            time.sleep(self.delay)
        self.last_stats = {"requests": len(requests), "seconds": self.delay * slow}
        return list(requests)

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_groups_of_engines_that_finish_first_are_handed_over_while_others_generate(
    ray_local,
):
    """The loop scores an engine's groups while the other engines still generate: `on_ready`
    gets the fast engine's groups (and not the last engine's), the result has every group."""
    placement = create_placement(
        num_trainers=0, num_engines=2, colocate=False, use_gpu=False, cpus_per_bundle=0.25
    )
    group = None
    try:
        group = RolloutGroup(
            functools.partial(SlowEngine, 3.0),
            num_engines=2,
            placement=placement,
            request_fn=lambda prompt: prompt,
            params_fn=dict,
            num_cpus=0.25,
        )
        handed: list[tuple[list[int], list[list[int]]]] = []
        prompts = list(range(6))  # engine 0: prompts 0-2 (slow: it has prompt 0), engine 1: 3-5
        groups = group.generate(prompts, n=2, on_ready=lambda i, g: handed.append((i, g)))
        assert groups == [[p, p] for p in prompts]
        assert handed == [([3, 4, 5], [[3, 3], [4, 4], [5, 5]])]
        assert all(groups[j] is g for j, g in zip(handed[0][0], handed[0][1], strict=True))
        # the engines' accounts: counts summed, seconds the slowest engine's
        assert group.engine_stats() == {"requests": 12, "seconds": 3.0}
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()


def _engine_starting_slowly(trigger: str) -> SlowEngine:
    """A `SlowEngine` whose start takes 20 s while the `trigger` file exists."""
    import os
    import time

    if os.path.exists(trigger):
        time.sleep(20.0)
    return SlowEngine(0.0)


def test_an_engine_no_node_holds_is_killed_when_the_run_stops(ray_local, monkeypatch, tmp_path):
    """A replacement engine whose bundle no live node holds for `node_wait_s` stops the run
    and is killed then: left pending, the group's shutdown would wait 30 s for its answer
    before the stop line is printed. A lost node's bundle (tests/test_ray_cluster.py) is
    stood for here by Ray's answer "no node"; the replacement takes long to start."""
    from rl_runtime import actor_group
    from rl_runtime.faults import RunStopped

    monkeypatch.setattr(actor_group, "POLL_S", 0.2)
    trigger = tmp_path / "slow"
    placement = create_placement(
        num_trainers=0, num_engines=1, colocate=False, use_gpu=False, cpus_per_bundle=0.25
    )
    group = None
    try:
        group = RolloutGroup(
            functools.partial(_engine_starting_slowly, str(trigger)),
            num_engines=1,
            placement=placement,
            request_fn=lambda prompt: prompt,
            params_fn=dict,
            num_cpus=0.25,
            node_wait_s=0.0,
        )
        trigger.touch()
        monkeypatch.setattr(actor_group, "bundle_node", lambda pg, bundle: "")
        with pytest.raises(RunStopped, match="rollout engine 0 could not be restarted"):
            group.restart([0])
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.workers[0].health.remote(), timeout=60)
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()


def _broken_trainer():
    raise RuntimeError("no such model: tiny-broken")


def test_a_trainer_group_started_without_waiting_reports_its_failure_at_ready(ray_local):
    """`wait=False` (the launcher starts the engines meanwhile) hands back a group at once; the
    rank's construction error surfaces at `ready()`, naming the rank and the cause."""
    placement = create_placement(
        num_trainers=1, num_engines=0, colocate=False, use_gpu=False, cpus_per_bundle=0.25
    )
    try:
        group = TrainGroup(
            _broken_trainer, world_size=1, placement=placement, num_cpus=0.25, wait=False
        )
        with pytest.raises(Exception, match="trainer rank 0") as err:
            group.ready()
        assert "tiny-broken" in str(err.value)
        group.ready()  # once reported, not waited for again
    finally:
        placement.remove()


class _SlowTrainer:
    """A trainer whose start-up takes a few seconds (a large model loading)."""

    def __init__(self) -> None:
        import time

        time.sleep(2.5)


def test_a_trainer_group_that_is_slow_to_start_says_so_naming_the_rank(
    ray_local, monkeypatch, caplog
):
    """A start-up that hangs names itself: while `ready()` waits, a note every
    `STARTUP_NOTE_S` names the ranks still starting (the Qwen3.5 launcher once waited 400 s
    with nothing logged)."""
    import logging

    from rl_runtime import actor_group

    monkeypatch.setattr(actor_group, "STARTUP_NOTE_S", 1.0)
    placement = create_placement(
        num_trainers=1, num_engines=0, colocate=False, use_gpu=False, cpus_per_bundle=0.25
    )
    try:
        group = TrainGroup(
            _SlowTrainer, world_size=1, placement=placement, num_cpus=0.25, wait=False
        )
        with caplog.at_level(logging.WARNING, logger="rl_runtime.actor_group"):
            group.ready()
        notes = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
        assert notes and all(n.startswith("trainer group: trainer rank 0 still") for n in notes)
        assert "the last start-up phase each rank logged" in notes[0]
    finally:
        placement.remove()


_HELD: list = []  # sockets a rank keeps open for its process's life


class _Joined:
    def __init__(self, rank: int) -> None:
        self.rank = rank


def _rank_whose_port_is_taken_once(trigger: str) -> _Joined:
    """A trainer rank that joins a gloo group. At the first start, rank 0 finds the rendezvous
    port taken: a socket listens on it (its own, as another process's would), so torch's
    TCPStore fails to bind it with EADDRINUSE, the error seen in the suite."""
    import os
    import socket
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    if os.environ["RANK"] == "0" and Path(trigger).exists():
        Path(trigger).unlink()
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.bind(("", int(os.environ["MASTER_PORT"])))
        held.listen()
        _HELD.append(held)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return _Joined(dist.get_rank())


def test_a_trainer_group_whose_rendezvous_port_was_taken_starts_again_on_another(
    ray_local, tmp_path, caplog
):
    """The port is chosen free and released until rank 0 binds it: a process that takes it in
    between failed the whole run at start. The group starts its ranks again on a new port."""
    import logging

    trigger = tmp_path / "take-the-port"
    trigger.touch()
    placement = create_placement(
        num_trainers=2, num_engines=0, colocate=False, use_gpu=False, cpus_per_bundle=0.25
    )
    group = None
    try:
        factory = functools.partial(_rank_whose_port_is_taken_once, str(trigger))
        with caplog.at_level(logging.WARNING, logger="rl_runtime.actor_group"):
            group = TrainGroup(factory, world_size=2, placement=placement, num_cpus=0.25)
        assert not trigger.exists()  # the first start did meet the taken port
        notes = [r.getMessage() for r in caplog.records if "rendezvous port" in r.getMessage()]
        assert len(notes) == 1 and "starting the ranks again on another port (1/3)" in notes[0]
        ranks = ray.get([w.__ray_call__.remote(lambda w: w.actor.rank) for w in group.workers])
        assert ranks == [0, 1]
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()
