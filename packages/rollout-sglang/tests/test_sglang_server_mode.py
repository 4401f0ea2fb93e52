"""Server mode, router and weight sync against real local HTTP servers (a stand-in speaking
SGLang's JSON, launched as subprocesses by SGLangServer), plus build_engine's choice."""

from __future__ import annotations

import logging
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import requests as http
import torch

from rollout_sglang import (
    DistributedWeightSender,
    EngineRouter,
    GenerateRequest,
    HFEngine,
    RequestLimits,
    RolloutConfig,
    SamplingParams,
    SGLangClient,
    SGLangConfig,
    SGLangServer,
    build_engine,
    sglang_available,
)

SERVER_SCRIPT = Path(__file__).with_name("sglang_like_server.py")
PARAMS = SamplingParams(max_new_tokens=4, seed=1)
SYNC_TIMEOUT = timedelta(seconds=60)  # every process group here fails rather than hangs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def servers():
    launched = []
    for _ in range(2):
        config = SGLangConfig(model_path="unused", port=free_port())
        command = [
            sys.executable,
            str(SERVER_SCRIPT),
            "--host",
            config.host,
            "--port",
            str(config.port),
            "--sync-timeout",
            str(SYNC_TIMEOUT.total_seconds()),
        ]
        launched.append(SGLangServer(config, command=command, wait=False))
    try:
        for server in launched:  # started together, waited for one by one
            server.wait_healthy(timeout=120)
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
    assert config.engine_kwargs()["mm_attention_backend"] == "sdpa"


def test_server_that_dies_at_start_is_reported():
    config = SGLangConfig(model_path="unused", port=free_port())
    with pytest.raises(RuntimeError, match="exited with code 3"):
        SGLangServer(
            config, command=[sys.executable, "-c", "raise SystemExit(3)"], startup_timeout=30
        )


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
    alone = client.generate([good, requests_[1]], PARAMS)
    assert [out[0].token_ids, out[7].token_ids] == [c.token_ids for c in alone]


def test_release_resume_memory(servers):
    client = SGLangClient(servers[1].url)
    client.release_memory()
    assert stats(servers[1].url)["released"] is True
    client.resume_memory()
    assert stats(servers[1].url)["released"] is False


def test_round_robin_router_splits_and_keeps_order(servers, requests_, limits):
    clients = [SGLangClient(s.url, limits=limits) for s in servers]
    router = EngineRouter(clients, policy="round_robin")
    direct = clients[0].generate(requests_, PARAMS)
    before = [stats(s.url)["requests"] for s in servers]
    routed = router.generate(requests_, PARAMS)
    after = [stats(s.url)["requests"] for s in servers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
    assert [c.token_ids for c in routed] == [c.token_ids for c in direct]
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


def test_distributed_weight_sync_to_two_servers(servers):
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
        assert sender.send(buckets) == 3
        for url in (s.url for s in servers):
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
