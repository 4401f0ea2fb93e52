"""Server mode, router and weight sync against real local HTTP servers (a stand-in answering as
sglang 0.5.23 does, launched as subprocesses by SGLangServer with the command line we would give
SGLang), plus build_engine's choice. Tests named after an item of issue #21 fail on the code
before that fix."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import requests as http
import torch

from rollout_sglang import RolloutConfig, build_engine
from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.router import EngineRouter
from rollout_sglang.sglang_client.client import SGLangClient
from rollout_sglang.sglang_client.common import SGLangConfig, sglang_available
from rollout_sglang.sglang_client.protocol import generate_payload
from rollout_sglang.sglang_client.server import SGLangServer
from rollout_sglang.types import GenerateRequest, SamplingParams
from rollout_sglang.validation import RequestLimits
from weight_sync.nccl import DistributedWeightSender
from weight_sync.weight_names import WeightNameCheck

MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 16  # the bounds of conftest's processor
SERVER_SCRIPT = Path(__file__).with_name("sglang_like_server.py")
PARAMS = SamplingParams(max_new_tokens=4, seed=1)
SYNC_TIMEOUT = timedelta(seconds=60)  # every process group here fails rather than hangs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stand_in_command(config: SGLangConfig, processor_dir: Path) -> list[str]:
    """The stand-in started with the flags we would pass ``sglang.launch_server``."""
    flags = config.server_command(python=sys.executable)[3:]
    timeout = ["--sync-timeout", str(SYNC_TIMEOUT.total_seconds())]
    return [sys.executable, str(SERVER_SCRIPT), *flags, "--processor", str(processor_dir), *timeout]


def server_config(**overrides) -> SGLangConfig:
    fields = {
        "model_path": "unused",
        "port": free_port(),
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "enable_deterministic_inference": True,
    }
    return SGLangConfig(**{**fields, **overrides})


def launch_stand_in(processor_dir: Path) -> SGLangServer:
    config = server_config()
    return SGLangServer(config, command=stand_in_command(config, processor_dir), wait=False)


def healthy(server: SGLangServer, processor_dir: Path) -> SGLangServer:
    """``server`` once healthy; where the port free_port() found was taken before the stand-in
    bound it (another test process, this module's other server), a stand-in started again on
    another port, up to three starts in all."""
    starts = 1
    while True:
        try:
            server.wait_healthy(timeout=120)
            return server
        except RuntimeError as err:
            if "Address already in use" not in str(err) or starts == 3:
                raise
        server.stop()
        server = launch_stand_in(processor_dir)
        starts += 1


@pytest.fixture(scope="module")
def servers(qwen3vl_dir):
    launched = [launch_stand_in(qwen3vl_dir) for _ in range(2)]
    try:
        for i, server in enumerate(launched):  # started together, waited for one by one
            launched[i] = healthy(server, qwen3vl_dir)
        yield launched
    finally:
        for server in launched:
            server.stop()


def stats(url: str) -> dict:
    return http.get(url + "/stats", timeout=10).json()


@pytest.fixture(scope="module")
def limits(tiny_model):
    config = tiny_model.config
    return RequestLimits(
        image_token_id=config.image_token_id,
        merge_size=config.vision_config.spatial_merge_size,
        max_prompt_length=200,
        needs_pixels=False,
    )


def test_server_binds_localhost_and_launch_command():
    config = SGLangConfig(
        model_path="Qwen/Qwen3-VL-2B-Instruct", mm_attention_backend="sdpa", port=31000
    )
    command = config.server_command(python="python")
    assert command[:3] == ["python", "-m", "sglang.launch_server"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--mm-attention-backend") + 1] == "sdpa"
    assert "--enable-memory-saver" in command
    assert "--mm-process-config" not in command  # no bounds: SGLang keeps its processor's
    assert config.engine_kwargs()["mm_attention_backend"] == "sdpa"


def test_issue21_item6_pixel_bounds_reach_sglang_as_json():
    config = SGLangConfig(
        model_path="m",
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        extra_args={"mm_process_config": {"video": {"fps": 2}}, "json_model_override_args": {}},
    )
    command = config.server_command(python="python")
    mm = json.loads(command[command.index("--mm-process-config") + 1])  # JSON, not str(dict)
    assert mm == {
        "video": {"fps": 2},
        "image": {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS},
    }
    assert config.engine_kwargs()["mm_process_config"] == mm  # in-process: the dict itself
    assert json.loads(command[command.index("--json-model-override-args") + 1]) == {}


def test_issue21_item6_engine_sees_the_trainers_image_token_counts(servers, requests_, limits):
    """The stand-in sizes images with the real HF image processor and the bounds from its
    command line: its expanded prompt is exactly the trainer's."""
    client = SGLangClient(servers[0].url, limits=limits)
    assert all(c.ok for c in client.generate(requests_, PARAMS))
    assert stats(servers[0].url)["expanded_lengths"] == [r.prompt_length for r in requests_]


def test_issue21_item2_one_image_pad_per_image(servers, requests_, limits):
    client = SGLangClient(servers[0].url, limits=limits)
    out = client.generate(requests_, PARAMS)
    assert all(c.ok for c in out), [c.error for c in out]
    pad = limits.image_token_id
    sent = stats(servers[0].url)["input_ids"]
    assert [ids.count(pad) for ids in sent] == [len(r.images) for r in requests_]
    # without limits the pads are found by mm_token_type_ids
    out = SGLangClient(servers[0].url).generate(requests_[:2], PARAMS)
    assert all(c.ok for c in out) and stats(servers[0].url)["input_ids"][0].count(pad) == 1


def test_issue21_item2_two_images_in_one_prompt(servers, requests_, limits):
    """Two images: expanded pads would fail SGLang's build_input_ids with AssertionError."""
    a, b = requests_[0], requests_[1]
    two = GenerateRequest(
        input_ids=torch.cat([a.input_ids, b.input_ids]),
        images=[*a.images, *b.images],
        request_id="two",
    )
    out = SGLangClient(servers[0].url, limits=limits).generate([two], PARAMS)
    assert out[0].ok, out[0].error
    assert stats(servers[0].url)["expanded_lengths"] == [two.prompt_length]
    expanded = http.post(
        servers[0].url + "/generate",
        json={
            "input_ids": two.input_ids.tolist(),
            "image_data": generate_payload([two], PARAMS, limits.image_token_id)["image_data"][0],
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
        },
        timeout=30,
    )
    assert expanded.status_code == 400 and "AssertionError" in expanded.text


def test_issue21_item5_each_sample_has_its_own_seed(servers, requests_, limits):
    client = SGLangClient(servers[0].url, limits=limits)
    group = [requests_[0]] * 4  # one prompt, n = 4 samples
    params = SamplingParams(max_new_tokens=6, seed=5)
    first = client.generate(group, params)
    seeds = [p["sampling_seed"] for p in stats(servers[0].url)["sampling_params"]]
    assert seeds == [5, 6, 7, 8]
    assert len({tuple(c.token_ids) for c in first}) == 4  # the GRPO group is not n copies
    again = client.generate(group, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]  # and reproducible


def test_server_that_dies_at_start_is_reported_with_its_last_output():
    """A server that exits before it is healthy raises with its exit code, the last lines it
    printed (a taken port, a missing model: the reason) and where its whole log is."""
    config = SGLangConfig(model_path="unused", port=free_port())
    dies = "import sys; print('OSError: [Errno 98] Address already in use', file=sys.stderr)"
    with pytest.raises(RuntimeError, match="exited with code 3") as raised:
        SGLangServer(
            config,
            command=[sys.executable, "-c", f"{dies}; raise SystemExit(3)"],
            startup_timeout=30,
        )
    message = str(raised.value)
    assert message.endswith("OSError: [Errno 98] Address already in use")
    log = Path(message.split("the last lines of its log ")[1].split(":\n")[0])
    assert log.name.startswith("sglang-server-") and "Address already in use" in log.read_text()


def test_generate_over_http(servers, requests_, limits):
    client = SGLangClient(servers[0].url, limits=limits)
    assert client.health()
    out = client.generate(requests_, PARAMS)
    assert all(c.ok and c.finish_reason == "length" and c.response_length == 4 for c in out)
    assert [c.request_id for c in out] == [r.request_id for r in requests_]
    assert out[0].logprobs == pytest.approx([-0.01, -0.02, -0.03, -0.04])
    # the stand-in derives tokens from prompt + image count: two prompts differ
    assert out[0].token_ids != out[1].token_ids
    # stop ids are honoured and the stop token is kept
    stop = out[0].token_ids[1]
    stopped = client.generate(
        requests_[:1], SamplingParams(max_new_tokens=4, stop_token_ids=(stop,), seed=1)
    )
    assert stopped[0].finish_reason == "stop" and stopped[0].token_ids == out[0].token_ids[:2]


def test_bad_requests_fail_alone_over_http(servers, requests_, limits):
    client = SGLangClient(servers[0].url, limits=limits)
    good = requests_[0]
    empty = GenerateRequest(input_ids=[])
    no_images = GenerateRequest(input_ids=good.input_ids, images=[])  # placeholders, no images
    refused = GenerateRequest(input_ids=[1, 2, 999997])  # the server answers 400 for the batch
    aborted = GenerateRequest(input_ids=[1, 999999])
    malformed = GenerateRequest(input_ids=[1, 999998])
    too_long = GenerateRequest(input_ids=torch.ones(201, dtype=torch.long))
    batch = [good, empty, no_images, refused, aborted, malformed, too_long, requests_[1]]
    out = client.generate(batch, PARAMS)
    assert [c.ok for c in out] == [True, False, False, False, False, False, False, True]
    assert "empty prompt" in out[1].error
    assert "no images" in out[2].error
    assert "HTTP 400" in out[3].error and "request 3" in out[3].error
    assert out[4].finish_reason == "abort" and "rejected" in out[4].error
    assert "no meta_info" in out[5].error
    assert "more than the limit 200" in out[6].error
    # the one-by-one retry kept each request's seed (base seed + its place in the batch)
    alone = client.generate([good, dataclasses.replace(requests_[1], seed=PARAMS.seed + 7)], PARAMS)
    assert [out[0].token_ids, out[7].token_ids] == [c.token_ids for c in alone]


def test_issue21_item3_flush_text_release_null_and_idle(servers):
    url = servers[1].url
    client = SGLangClient(url)
    before = stats(url)["flushes"]
    client.flush_cache()  # a plain-text answer
    assert stats(url)["flushes"] == before + 1
    client.release_memory()  # answers null
    assert stats(url)["released"] is True
    client.resume_memory()
    assert stats(url)["released"] is False
    # by parts, as the colocated loop resumes: the weights for the push, the cache after
    client.release_memory()
    client.resume_memory(("weights",))
    assert stats(url)["offloaded"] == ["cuda_graph", "kv_cache"]
    client.resume_memory(("kv_cache", "cuda_graph"))
    assert stats(url)["offloaded"] == []
    client.resume_memory(("kv_cache",))  # nothing released: not asked (SGLang would refuse)
    answer = http.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=10)
    assert answer.status_code == 400 and "kv_cache" in answer.json()["error"]["message"]
    # a request in flight: SGLang refuses to release, and so does the client, before asking
    held = GenerateRequest(input_ids=[1, 2, 999996])
    worker = threading.Thread(target=client.generate, args=([held], PARAMS))
    worker.start()
    try:
        while stats(url)["running"] == 0:
            pass
        with pytest.raises(RuntimeError, match="still running"):
            client.release_memory()
        answer = http.post(url + "/release_memory_occupation", json={}, timeout=10)
        assert answer.status_code == 400 and "idle" in answer.json()["error"]["message"]
        with pytest.raises(RuntimeError, match="HTTP 400"):
            SGLangClient(url).flush_cache()
    finally:
        http.post(url + "/test_unblock", json={}, timeout=10)
        worker.join()
    assert stats(url)["released"] is False


def test_issue21_item4_server_mode_refuses_cpu_tensors(servers):
    url = servers[1].url
    client = SGLangClient(url)
    before = stats(url)
    with pytest.raises(ValueError, match=r"CUDA tensors .* or the NCCL path"):
        client.update_weights([[("model.language_model.norm.weight", torch.ones(4))]])
    after = stats(url)
    assert after["updates"] == before["updates"] and after["session"] is False


def test_serialized_flattened_buckets_reach_the_server_in_a_session(servers):
    """What the CUDA IPC transport sends a colocated server per bucket (payloads it serialized,
    ``weight_sync.cuda_ipc``): refused outside a session, accepted inside, as they are."""
    url = servers[1].url
    client = SGLangClient(url)
    payloads = [base64.b64encode(b"\x80\x04payload").decode()]
    with pytest.raises(RuntimeError, match="between begin_weight_update"):
        client.update_weights_from_serialized(["model.language_model.norm.weight"], payloads)
    before = stats(url)
    client.begin_weight_update()
    try:
        client.update_weights_from_serialized(["model.language_model.norm.weight"], payloads)
    finally:
        client.end_weight_update()
    after = stats(url)
    assert after["updates"] == before["updates"] + 1
    assert after["load_formats"][-1] == "flattened_bucket"


def test_issue21_item8_unknown_weight_name_fails_loudly(servers, tiny_model):
    from vlm_models.weights import hf_named_tensors

    names = WeightNameCheck.from_names(n for n, _ in hf_named_tensors(tiny_model))
    client = SGLangClient(servers[1].url, weight_names=names)
    renamed = "model.language_model.layers.0.mlp.gate_projection.weight"
    with pytest.raises(ValueError, match=r"gate_projection.*skipped by SGLang"):
        client.update_weights([[(renamed, torch.ones(2))]])
    with pytest.raises(ValueError, match="skipped by SGLang"):
        client.update_weights_from_distributed(
            names=[renamed], dtypes=["float32"], shapes=[[2]], group_name="g"
        )
    # the NCCL path checks before any engine waits for a broadcast, and closes the sessions
    sender = DistributedWeightSender(
        [client],
        master_address="127.0.0.1",
        backend="gloo",
        timeout=SYNC_TIMEOUT,
        weight_names=names,
        group_name="names_check",  # a group of its own: the sync test below makes another
    )
    try:
        with pytest.raises(ValueError, match="skipped by SGLang"):
            sender.send([[(renamed, torch.ones(2))]])
    finally:
        sender.close()
    assert stats(servers[1].url)["session"] is False


def test_round_robin_router_splits_and_keeps_order(servers, requests_, limits):
    clients = [SGLangClient(s.url, limits=limits) for s in servers]
    router = EngineRouter(clients, policy="round_robin")
    direct = clients[0].generate(requests_, PARAMS)
    before = [stats(s.url)["requests"] for s in servers]
    routed = router.generate(requests_, PARAMS)
    after = [stats(s.url)["requests"] for s in servers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
    assert [c.token_ids for c in routed] == [c.token_ids for c in direct]  # seeds by position
    assert router.assign(requests_[:3], PARAMS) == [[2], [0, 1]]  # next call starts at engine 1
    assert router.health()


def test_least_loaded_router_balances_tokens(servers):
    router = EngineRouter([SGLangClient(s.url) for s in servers], policy="least_loaded")
    long, short = (
        GenerateRequest(input_ids=torch.ones(100, dtype=torch.long)),
        GenerateRequest(input_ids=[1]),
    )
    parts = router.assign([long, short, short, short], PARAMS)
    assert parts == [[0], [1, 2, 3]]
    assert router.in_flight == [104, 15]


def test_router_isolates_a_failing_engine(servers, requests_):
    class Broken:
        def generate(self, requests, params):
            raise ConnectionError("engine down")

    router = EngineRouter([SGLangClient(servers[0].url), Broken()], policy="round_robin")
    out = router.generate(requests_, PARAMS)
    assert [c.ok for c in out] == [True, True, False, False]
    assert "engine down" in out[2].error


def test_issue21_item1_distributed_weight_sync_to_two_servers_in_a_session(servers):
    clients = [SGLangClient(s.url) for s in servers]
    # master_port=0: the sender's store picks a free port itself (no race for a port)
    sender = DistributedWeightSender(
        clients, master_address="127.0.0.1", backend="gloo", timeout=SYNC_TIMEOUT
    )
    try:
        assert sender.master_port > 0
        torch.manual_seed(0)
        weights = {
            "model.language_model.embed_tokens.weight": torch.randn(8, 4, dtype=torch.bfloat16),
            "model.visual.patch_embed.proj.weight": torch.randn(4, 3, 2, 2, 2),
            "lm_head.bias": torch.arange(5, dtype=torch.float32),
        }
        buckets = [list(weights.items())[:2], list(weights.items())[2:]]
        before = [stats(s.url) for s in servers]
        assert sender.send(buckets) == 3  # refused outside a session by sglang 0.5.23
        for url, old in zip((s.url for s in servers), before, strict=True):
            new = stats(url)
            assert new["updates"] == old["updates"] + 2
            assert new["refused_updates"] == old["refused_updates"]
            assert new["session"] is False and new["flushes"] == old["flushes"] + 1
            for name, tensor in weights.items():
                got = http.post(
                    url + "/get_weights_by_name", json={"name": name}, timeout=10
                ).json()
                assert got == tensor.float().flatten().tolist()
    finally:
        sender.close()


def test_weight_sync_fails_when_an_engine_never_joins():
    class Absent:
        """Answers the join request but never joins the group."""

        def init_weights_update_group(self, **kwargs):
            return {"success": True, "message": "pretending"}

    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        DistributedWeightSender(
            [Absent()], master_address="127.0.0.1", backend="gloo", timeout=timedelta(seconds=2)
        )


def test_build_engine_picks_hf_without_sglang(tiny_model, caplog):
    if sglang_available():
        pytest.skip("sglang is installed here")
    with caplog.at_level(logging.INFO, logger="rollout_sglang"):
        engine = build_engine(RolloutConfig(backend="auto"), model=tiny_model)
    assert isinstance(engine, HFEngine)
    assert "using the transformers HFEngine" in caplog.text
    assert "uv sync --extra gpu" in caplog.text


def test_asking_for_sglang_without_it_says_how_to_install():
    if sglang_available():
        pytest.skip("sglang is installed here")
    with pytest.raises(ImportError, match="uv sync --extra gpu"):
        build_engine(RolloutConfig(backend="sglang", model_path="x"))
    with pytest.raises(ImportError, match="uv sync --extra gpu"):
        SGLangServer(SGLangConfig(model_path="x"))


def test_build_engine_server_urls_gives_a_router(servers, tiny_model, requests_):
    config = RolloutConfig(backend="sglang-server", server_urls=[s.url for s in servers])
    engine = build_engine(config, model=tiny_model)
    assert isinstance(engine, EngineRouter) and len(engine.engines) == 2
    assert all(c.ok for c in engine.generate(requests_, PARAMS))
