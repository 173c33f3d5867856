"""A local ``atomr serve`` for the HTTP tests, run as a user runs it.

The Ray cluster and the ``smollm2`` deployment are the session fixtures of ``tests/conftest.py``
(shared with the integration tier). ``atomr serve`` runs as a subprocess joined to that cluster
on a free loopback port; at the end it gets Ctrl-C (SIGINT) and must delete its Serve
application and exit 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ATOMR = Path(sys.executable).parent / "atomr"
START_TIMEOUT_S = 180.0
# Requests to a deployment without a ready replica wait this long before 503.
REPLICA_WAIT_S = 3.0


@dataclass
class RunningServer:
    url: str
    proc: subprocess.Popen[str]
    output: list[str]

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))


@pytest.fixture(scope="session")
def openai_server(ray_cluster, manager, smollm2) -> Iterator[RunningServer]:
    """``atomr serve`` on 127.0.0.1:<free port>, joined to the test cluster, ``smollm2`` ready."""
    if not ATOMR.exists():
        pytest.fail(f"atomr console script not found at {ATOMR}: install the package into this environment")
    port = free_port()
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    cmd = [str(ATOMR), "serve", "--host", "127.0.0.1", "--port", str(port), "--address", address]
    cmd += ["--replica-wait", str(REPLICA_WAIT_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    server = RunningServer(f"http://127.0.0.1:{port}", proc, lines)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any("openai client:" in line for line in lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("atomr serve did not start:\n" + "\n".join(lines[-40:]))
            time.sleep(0.2)
        assert any(f'base_url="{server.base_url}"' in line for line in lines), lines
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, "atomr serve did not exit cleanly:\n" + "\n".join(lines[-40:])
    with pytest.raises(httpx.TransportError):  # the proxy is gone with the app
        httpx.get(f"{server.url}/health", timeout=5)
