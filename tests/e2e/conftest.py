"""A local ``atomr serve`` for the HTTP tests, run as a user runs it.

The Ray cluster and the ``smollm2`` deployment are the session fixtures of ``tests/conftest.py``
(shared with the integration tier). ``atomr serve`` runs as a subprocess joined to that cluster
on a free loopback port; at the end it gets Ctrl-C (SIGINT) and must delete its Serve
application and exit 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from atomr_infer.local_ray import free_port
from tests.atomr_serve import ATOMR, AtomrServe

START_TIMEOUT_S = 180.0
# Requests to a deployment without a ready replica wait this long before 503.
REPLICA_WAIT_S = 3.0


@dataclass
class RunningServer:
    url: str
    serve: AtomrServe

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture(scope="session")
def openai_server(ray_cluster, manager, smollm2) -> Iterator[RunningServer]:
    """``atomr serve`` on 127.0.0.1:<free port>, joined to the test cluster, ``smollm2`` ready."""
    if not ATOMR.exists():
        pytest.fail(f"atomr console script not found at {ATOMR}: install the package into this environment")
    port = free_port()
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    args = ["--host", "127.0.0.1", "--port", str(port), "--address", address, "--replica-wait", str(REPLICA_WAIT_S)]
    serve = AtomrServe(args, env, START_TIMEOUT_S)
    server = RunningServer(f"http://127.0.0.1:{port}", serve)
    try:
        assert any(f'base_url="{server.base_url}"' in line for line in serve.lines), serve.lines
        yield server
    finally:
        code = serve.interrupt(60)
    assert code == 0, "atomr serve did not exit cleanly:\n" + "\n".join(serve.lines[-40:])
    assert serve.lines[-1] == f"stopped the API at {server.url}", serve.lines[-40:]
    with pytest.raises(httpx.TransportError):  # the proxy is gone with the app
        httpx.get(f"{server.url}/health", timeout=5)
