"""A Ray cluster of several nodes on loopback (one head and worker nodes, each its own raylet
with logical GPUs, as ``ray start`` makes them), and a manager on its head.

Its own pytest session (``make test`` runs this directory after the others): a process joins
one Ray cluster, and the other tiers share another. The replicas run the emulated engine
(vLLM's real front half over a core that only keeps time, atomr_infer/engine/vllm/emulated.py): the
GPUs here are logical, and a real engine per node would need more cores than these machines
have. Everything else is the real code: the manager, the replica actors, routers, Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray

pytestmark = pytest.mark.integration
WORKERS = 2
GPUS_PER_WORKER = 2
WORKER_CPUS = 4
STEP_S = 0.02  # the emulated engine's step: 50 tokens/s per request
# Found dead within a few seconds, as a cluster would configure for fast failover (Ray's
# defaults take ~30 s: a 3 s health-check period, 5 misses, a 10 s timeout each).
FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


class LoopbackCluster:
    """A head and worker nodes, each started with ``ray start`` on 127.0.0.1 with ports of its
    own (``ray.cluster_utils.Cluster`` is not used: on a machine with a second interface its
    nodes advertise that one, and drivers then wait for a GCS they cannot reach)."""

    def __init__(self, temp_dir: str) -> None:
        from atomr_infer.local_ray import free_port

        self.temp_dir = temp_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.worker_ports: list[int] = []  # each worker's node-manager port: how it is found and killed
        self._ray = os.path.join(os.path.dirname(sys.executable), "ray")

    def _start(self, *args: str) -> None:
        cmd = [self._ray, "start", "--node-ip-address=127.0.0.1", "--disable-usage-stats", *args]
        # `ray start --head` turns token auth on when ~/.ray/auth_token exists; a node joining
        # it must be told to send the token.
        env = {**os.environ, "RAY_AUTH_MODE": "token"} if Path.home().joinpath(".ray", "auth_token").exists() else None
        proc = subprocess.run(
            cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")

    def start_head(self) -> None:
        from atomr_infer.local_ray import free_port

        self._start(
            "--head", f"--port={self.port}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}", f"--system-config={json.dumps(FAST_FAILURE_DETECTION)}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=10002", "--max-worker-port=13999",  # the workers' nodes take 14000 on
        )

    def add_worker(self) -> None:
        from atomr_infer.local_ray import free_port

        node_port = free_port()
        low = 14000 + 1000 * len(self.worker_ports)
        self._start(
            f"--address={self.address}", f"--num-cpus={WORKER_CPUS}", f"--num-gpus={GPUS_PER_WORKER}",
            f"--node-manager-port={node_port}", f"--object-manager-port={free_port()}",
            f"--min-worker-port={low}", f"--max-worker-port={low + 400}",
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        )
        self.worker_ports.append(node_port)

    def worker_node_ids(self) -> dict[str, int]:
        """Alive worker nodes: node id -> node-manager port."""
        return {
            n["NodeID"]: n["NodeManagerPort"] for n in ray.nodes()
            if n["Alive"] and n["NodeManagerPort"] in self.worker_ports
        }

    def kill_worker(self, node_id: str) -> None:
        """The node's machine goes away: SIGKILL its raylet and everything the raylet started."""
        port = self.worker_node_ids()[node_id]
        flag = f"--node_manager_port={port}"
        raylet = next(p for p in psutil.process_iter(["name"]) if "raylet" in (p.info["name"] or "")
                      and flag in " ".join(p.cmdline()))
        doomed = [raylet, *raylet.children(recursive=True)]
        for proc in doomed:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(doomed, timeout=10)

    def stop(self) -> None:
        from atomr_infer.local_ray import forget_address, stop_head

        stop_head(self.port)
        forget_address(self.port, None)  # `ray start` recorded it in /tmp/ray for `address="auto"`


@pytest.fixture(scope="session")
def cluster():
    from atomr_infer.cluster import connect

    if ray.is_initialized():
        pytest.fail("tests/multinode runs in its own pytest session: `pytest tests/multinode`")
    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="atomr-mn-", dir="/tmp")  # short: Ray's socket paths have a limit
    c = LoopbackCluster(temp_dir)
    try:
        c.start_head()
        for _ in range(WORKERS):
            c.add_worker()
        connect(c.address)  # the path atomr's CLI takes, auth token included
        deadline = time.monotonic() + 60
        while len(c.worker_node_ids()) < WORKERS and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(c.worker_node_ids()) == WORKERS, ray.nodes()
        yield c
    finally:
        ray.shutdown()
        c.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def emulated_manager(model_dir) -> ray.actor.ActorHandle:
    """A ``DeploymentManager`` created as ``manager_handle`` creates it (on the head), whose
    replicas run the emulated engine; once it answers."""
    from atomr_infer.control.client import manager_options
    from atomr_infer.control.manager import DeploymentManager
    from atomr_infer.control.ray_replicas import RayReplicaLauncher
    from atomr_infer.engine.vllm.emulated import emulated_backend

    backend = emulated_backend(str(model_dir), STEP_S)
    launcher = RayReplicaLauncher(lambda spec: True, replica_kwargs={"backend": backend})
    handle = ray.remote(DeploymentManager).options(**manager_options()).remote(launcher=launcher)
    ray.get(handle.ping.remote())
    return handle


@pytest.fixture(scope="session")
def manager(cluster, bundled_model_dir):
    """The cluster's manager (``emulated_manager``)."""
    handle = emulated_manager(bundled_model_dir)
    yield handle
    with contextlib.suppress(Exception):
        for status in ray.get(handle.list.remote()):
            ray.get(handle.remove.remote(status.name))
        deadline = time.monotonic() + 30
        while ray.get(handle.list.remote()) and time.monotonic() < deadline:
            time.sleep(0.5)
    ray.kill(handle)
