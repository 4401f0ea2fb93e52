"""What a local Ray started by `init_ray` exposes on the network (real Ray, one CPU).

Glimpse starts no Ray HTTP endpoint on the network (the dashboard is off; its agents bind
127.0.0.1; no Ray client server) and its own servers (SGLang, see rollout-sglang's tests) bind
127.0.0.1. Ray 2.60's gRPC servers (GCS, raylet, workers) listen on every interface whatever
`ray.init` is given (it maps 127.0.0.1 back to the node's address), behind Ray's token
authentication, which is on; ray-project/ray#59852 binds them to the node address. The strict
xfail below turns into a failure when a Ray upgrade changes that, so the docs get updated.
"""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest
import ray

from rl_runtime import init_ray

LOOPBACK = {"127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def listeners():
    """(process command line, address) of every listening socket of this process's tree."""
    if os.environ.get("RAY_AUTH_MODE") not in (None, "token"):
        pytest.skip("RAY_AUTH_MODE is set to something else here")
    # A cluster `ray start` recorded (RAY_ADDRESS, or /tmp/ray/ray_current_cluster) is not
    # joined: init_ray starts a Ray of its own (a bare ray.init() would try this address).
    os.environ["RAY_ADDRESS"] = "127.0.0.1:9"
    try:
        init_ray(num_cpus=1)
    finally:
        del os.environ["RAY_ADDRESS"]
    assert ray.get_runtime_context().gcs_address != "127.0.0.1:9"
    try:
        me = psutil.Process()
        procs = {p.pid: p.cmdline() for p in [me, *me.children(recursive=True)]}
        yield [
            (procs[c.pid], c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in procs
        ]
    finally:
        ray.shutdown()


def _exposed(ip: str) -> bool:
    return ip not in LOOPBACK and not ipaddress.ip_address(ip).is_loopback


def _is_http_server(cmdline: list[str]) -> bool:
    """Ray's HTTP processes: the dashboard head and its agent (Python scripts)."""
    return any(a.endswith(("dashboard/dashboard.py", "dashboard/agent.py")) for a in cmdline[:3])


def test_no_ray_http_endpoint_is_reachable_from_outside(listeners):
    assert listeners  # the fixture really sees Ray's sockets
    web = [(cmd[:2], ip, port) for cmd, ip, port in listeners if _is_http_server(cmd)]
    assert not [x for x in web if _exposed(x[1])], web
    assert not [x for x in listeners if x[2] in (8265, 10001)]  # dashboard, Ray client


def test_ray_token_authentication_is_on(listeners):
    """What guards the gRPC ports that Ray 2.60 opens on every interface."""
    assert os.environ.get("RAY_AUTH_MODE") == "token"


@pytest.mark.xfail(strict=True, reason="Ray 2.60's gRPC servers listen on all interfaces")
def test_every_ray_listener_is_on_loopback(listeners):
    assert not [x for x in listeners if _exposed(x[1])]
