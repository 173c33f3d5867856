"""A Ray cluster with GCS fault tolerance on loopback: a real Redis (Debian's ``redis-server``,
installed by ``make setup`` where it runs as root) holding the GCS's tables, a head started
against it and a worker node with logical GPUs, as ``ray start`` makes them; a manager on the
head whose replicas (on the worker) run the emulated engine, as tests/multinode's do.

Its own pytest session (``make test`` runs this directory after tests/multinode): the head's
GCS is killed and brought back under the tests' feet, which no other tier may share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import ray

from tests.multinode.conftest import LoopbackCluster, emulated_manager

pytestmark = pytest.mark.integration
REDIS = shutil.which("redis-server")
# How long raylets, workers and drivers wait for a GCS that went away before they give up (Ray's
# default is 60 s; the outages here last seconds).
RECONNECT_S = 120


@dataclass
class SavedProcess:
    """What it takes to start a process again as it was: a restarted head pod runs the same."""

    cmdline: list[str]
    env: dict[str, str]
    cwd: str


class FtCluster(LoopbackCluster):
    def __init__(self, temp_dir: str) -> None:
        from atomr_infer.local_ray import free_port

        super().__init__(temp_dir)
        self.redis_port = free_port()
        self.redis: subprocess.Popen | None = None
        self.restarted: list[subprocess.Popen] = []

    def start_redis(self) -> None:
        from atomr_infer.local_ray import port_open

        assert REDIS is not None
        self.redis = subprocess.Popen(
            [REDIS, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", self.redis_port):
            assert time.monotonic() < deadline and self.redis.poll() is None, "redis-server did not start"
            time.sleep(0.1)

    def worker_node_id(self) -> str:
        (node_id,) = self.worker_node_ids()
        return node_id

    def kill_gcs(self) -> SavedProcess:
        """SIGKILL the head's GCS server; what it was started with, to start it again."""
        from atomr_infer.local_ray import gcs_server

        gcs = gcs_server(self.port)
        assert gcs is not None
        saved = SavedProcess(gcs.cmdline(), gcs.environ(), gcs.cwd())
        gcs.kill()
        gcs.wait(10)
        return saved

    def kill_head(self) -> None:
        """SIGKILL every process of the head node (its GCS, its raylet and everything that
        raylet started: the manager with them), as when the head's machine or pod goes; the
        worker node's processes and this one stay."""
        from atomr_infer.local_ray import forget_address, head_processes

        keep = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        for port in self.worker_ports:
            flag = f"--node_manager_port={port}"
            for raylet in psutil.process_iter(["name"]):
                if "raylet" in (raylet.info["name"] or "") and flag in " ".join(raylet.cmdline()):
                    keep |= {raylet.pid, *(c.pid for c in raylet.children(recursive=True))}
        doomed = [p for p in head_processes(self.port) if p.pid not in keep]
        for proc in doomed:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(doomed, timeout=10)
        # And its disk: the file `ray start` left naming the running cluster (a new head pod has none).
        forget_address(self.port, self.temp_dir)

    def restart(self, saved: SavedProcess) -> None:
        log = open(Path(self.temp_dir) / "gcs_restarted.out", "ab")  # noqa: SIM115 - the process keeps it
        self.restarted.append(subprocess.Popen(
            saved.cmdline, env=saved.env, cwd=saved.cwd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True,
        ))

    def stop(self) -> None:
        super().stop()
        # Whatever is left of this cluster (a head killed by a test has no GCS for stop_head to find).
        left = [p for p in psutil.process_iter() if self.temp_dir in " ".join(_cmdline(p))]
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=10)
        for proc in [*self.restarted, *([self.redis] if self.redis else [])]:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(scope="session")
def cluster():
    from atomr_infer.cluster import connect

    if REDIS is None:
        pytest.skip("redis-server is not installed (`make setup` installs Debian's where it runs as root with apt)")
    if ray.is_initialized():
        pytest.fail("tests/headft runs in its own pytest session: `pytest tests/headft`")
    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="atomr-ft-", dir="/tmp")  # short: Ray's socket paths have a limit
    c = FtCluster(temp_dir)
    saved_env = dict(os.environ)
    try:
        c.start_redis()
        # Read by `ray start --head` (the GCS keeps its tables in this Redis, under a namespace of
        # this cluster's own) and by every process of the cluster, this one included.
        os.environ.update({
            "RAY_REDIS_ADDRESS": f"127.0.0.1:{c.redis_port}",
            "RAY_external_storage_namespace": f"atomr-test-{uuid.uuid4().hex[:8]}",
            "RAY_gcs_rpc_server_reconnect_timeout_s": str(RECONNECT_S),
        })
        c.start_head()
        c.add_worker()
        connect(c.address)
        deadline = time.monotonic() + 60
        while len(c.worker_node_ids()) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(c.worker_node_ids()) == 1, ray.nodes()
        yield c
    finally:
        ray.shutdown()
        c.stop()
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def manager(cluster, bundled_model_dir):
    """The cluster's manager (``emulated_manager``); removed at the end with timeouts, as the head
    it runs on may have been replaced."""
    handle = emulated_manager(bundled_model_dir)
    yield handle
    with contextlib.suppress(Exception):
        for status in ray.get(handle.list.remote(), timeout=30):
            ray.get(handle.remove.remote(status.name), timeout=30)
    with contextlib.suppress(Exception):
        ray.kill(handle)
