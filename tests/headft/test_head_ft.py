"""The head's GCS killed under load and brought back with its own command line, then the whole
head node's processes killed and the head started again, with GCS fault tolerance against a
real Redis: the replicas on the worker node serve throughout (load from an actor on the worker
node, not from the head), the manager keeps its records and its replicas (no replica restarted,
none duplicated; after the head's loss it is restarted on the new head and re-adopts them), an
apply made just before the kill is kept, and ``atomr status`` and applies work again afterwards."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from atomr_infer.control.client import ControlPlane
from tests.conftest import smollm2_spec

pytestmark = pytest.mark.integration
ATOMR = Path(sys.executable).parent / "atomr"
NAME = "steady"
TOKENS = 500  # 10 s a stream at the emulated engine's 50 tokens/s


def spec(**kw):
    return smollm2_spec(**{"name": NAME, "device": "auto", "replicas": 2, **kw})


@ray.remote(num_cpus=0)
class Load:
    """Requests from the worker node through the ``Client``: long streams, and short requests one
    after another until ``stop``; each outcome kept."""

    def __init__(self, manager) -> None:
        from atomr_infer.client import Client

        self.client = Client(manager=manager)
        self.streams: list[tuple] = []
        self.short: list[tuple] = []
        self.running = True
        self.threads: list[threading.Thread] = []

    def start(self, streams: int) -> None:
        self.threads = [threading.Thread(target=self._stream, daemon=True) for _ in range(streams)]
        self.threads.append(threading.Thread(target=self._short, daemon=True))
        for thread in self.threads:
            thread.start()

    def _stream(self) -> None:
        try:
            finish, used = None, None
            for chunk in self.client.stream_complete(NAME, "hi", max_tokens=TOKENS, ignore_eos=True,
                                                     stream_options={"include_usage": True}):
                used = chunk.usage.completion_tokens if chunk.usage is not None else used
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            self.streams.append(("ok", finish, used))
        except Exception as exc:  # noqa: BLE001 - the test reports every failure
            self.streams.append(("error", f"{type(exc).__name__}: {exc}"))

    def _short(self) -> None:
        while self.running:
            started = time.time()
            try:
                reply = self.client.complete(NAME, "still there?", max_tokens=4)
                self.short.append(("ok", started, time.time() - started, reply.choices[0].text))
            except Exception as exc:  # noqa: BLE001
                self.short.append(("error", started, f"{type(exc).__name__}: {exc}"))
            time.sleep(0.2)

    def started(self) -> int:
        return len(self.short)

    def results(self) -> tuple[list, list]:
        self.running = False
        for thread in self.threads:
            thread.join(120)
        return self.streams, self.short


def wait_for_gcs(manager, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(manager.ping.remote(), timeout=5)
            ControlPlane(manager).status(NAME)
            return
        except Exception:  # noqa: BLE001 - the GCS is still coming back
            assert time.monotonic() < deadline, "the cluster did not come back"
            time.sleep(1)


def deployed_under_load(cluster, manager, max_concurrent: int, **load_options):
    """Two replicas on the worker, the ``Load`` actor (on the worker too) streaming through them,
    then an apply in place (a limit: the replicas stay), as just before an outage. The control
    plane, the ready replicas' actor ids, the load actor and the apply's result."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cp = ControlPlane(manager)
    cp.apply(spec())
    status = cp.wait_ready(NAME, 300)
    assert status is not None and status.replicas_ready == 2, status
    ready = [r for r in status.replicas if r.state == "ready"]
    worker = cluster.worker_node_id()
    assert {r.node_id for r in ready} == {worker}  # the head has no GPUs
    strategy = NodeAffinitySchedulingStrategy(worker, soft=False)
    load = Load.options(scheduling_strategy=strategy, **load_options).remote(manager)
    ray.get(load.start.remote(6))
    deadline = time.monotonic() + 60
    while ray.get(load.started.remote()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    result = cp.apply(spec(serving={**spec().serving.model_dump(), "max_concurrent": max_concurrent}))
    assert result.changed
    return cp, sorted(r.actor_id for r in ready), load, result


def served_throughout(load, killed: float, back: float) -> tuple[list, list]:
    """The load's outcome: every stream whole, no request failed, some served during the outage
    (from ``killed`` to ``back``). The streams and the requests served during it."""
    streams, short = ray.get(load.results.remote(), timeout=180)
    assert len(streams) == 6 and all(s == ("ok", "length", TOKENS) for s in streams), streams
    assert not [s for s in short if s[0] == "error"], short
    during = [s for s in short if killed < s[1] < back - 1]
    assert during, (back - killed, [(round(s[1] - killed, 1), round(s[2], 2)) for s in short])
    return streams, during


def atomr_status_works(address: str) -> None:
    shown = subprocess.run([str(ATOMR), "status", "--address", address], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and NAME in shown.stdout, shown.stderr


def outage_line(what: str, killed: float, back: float, streams: list, during: list) -> str:
    latency = sorted(s[2] for s in during)
    return (f"{what} down {back - killed:.1f} s; {len(during)} requests served meanwhile (latency p50 "
            f"{latency[len(latency) // 2]:.2f} s, max {latency[-1]:.2f} s); {len(streams)} streams of {TOKENS} "
            "tokens whole")


def test_the_gcs_killed_and_restarted_under_load_loses_nothing(cluster, manager):
    cp, actors, load, result = deployed_under_load(cluster, manager, 48)

    saved = cluster.kill_gcs()
    killed = time.time()
    time.sleep(5)  # the outage: the replicas serve on, the manager cannot reach the GCS
    cluster.restart(saved)
    wait_for_gcs(manager)
    back = time.time()

    streams, during = served_throughout(load, killed, back)
    after = cp.status(NAME)
    assert sorted(r.actor_id for r in after.replicas) == actors  # no replica restarted or added
    assert after.generation == result.generation  # the apply made just before the kill is kept
    atomr_status_works(cluster.address)
    cp.apply(spec(replicas=1))  # an apply works again: one replica drains and stops
    deadline = time.monotonic() + 60
    while True:
        replicas = cp.status(NAME).replicas
        if sorted(r.state for r in replicas) == ["ready", "stopped"]:
            break
        assert time.monotonic() < deadline, [(r.replica_id, r.state, r.reason) for r in replicas]
        time.sleep(0.5)
    print("\n" + outage_line("GCS", killed, back, streams, during))
    cp.remove(NAME)


def test_the_whole_head_killed_and_started_again_keeps_the_replicas(cluster, manager):
    from atomr_infer.cluster import connect
    from atomr_infer.control.client import MANAGER_NAME, NAMESPACE

    _, actors, _, result = deployed_under_load(
        cluster, manager, 40, name="headft-load", namespace=NAMESPACE, lifetime="detached"
    )

    ray.shutdown()  # this process is a driver on the head's raylet: it would go with the head
    cluster.kill_head()
    killed = time.time()
    time.sleep(3)
    cluster.start_head()  # the same port and Redis: a restarted head pod runs the same command
    connect(cluster.address)
    manager = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)  # restarted by Ray on the new head
    wait_for_gcs(manager, timeout_s=120)
    back = time.time()
    cp = ControlPlane(manager)

    load = ray.get_actor("headft-load", namespace=NAMESPACE)
    streams, during = served_throughout(load, killed, back)
    ray.kill(load)
    deadline = time.monotonic() + 60
    while True:  # the restarted manager re-adopts the replicas it started: the same actors
        after = cp.status(NAME)
        if after is not None and after.replicas_ready == 2:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    assert sorted(r.actor_id for r in after.replicas if r.state == "ready") == actors
    assert after.generation == result.generation
    atomr_status_works(cluster.address)
    print("\n" + outage_line("head", killed, back, streams, during) + f"; manager re-adopted {len(actors)} replicas")
    cp.remove(NAME)
