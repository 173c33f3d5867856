"""Placement across nodes, and the loss of a worker node, on a 3-node loopback cluster."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from atomr_infer.client import Client
from atomr_infer.control.client import ControlPlane
from atomr_infer.control.placement import head_node_id
from tests.conftest import smollm2_spec

pytestmark = pytest.mark.integration


def spec(name: str, **kw):
    # device auto: the replicas reserve the cluster's (logical) GPUs, one each unless `gpus`.
    return smollm2_spec(name=name, device="auto", **kw)


def deploy(manager, dep, timeout_s: float = 300):
    cp = ControlPlane(manager)
    cp.apply(dep)
    status = cp.wait_ready(dep.name, timeout_s)
    assert status is not None and status.state in ("ready", "idle"), status
    return status


def remove(manager, name: str) -> None:
    cp = ControlPlane(manager)
    cp.remove(name)
    deadline = time.monotonic() + 60
    while cp.status(name) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    # And its actors are gone (the reaper kills them after their shutdown): the next test's
    # placement sees every GPU free.
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources().get("GPU", 0):
        assert time.monotonic() < deadline, "the removed replicas still hold GPUs"
        time.sleep(0.5)


def test_the_manager_runs_on_the_head_node(manager):
    assert ray.get(manager.node_id.remote()) == head_node_id()


def test_replicas_spread_across_nodes_by_default(cluster, manager):
    status = deploy(manager, spec("spread", replicas=2))
    try:
        nodes = [r.node_id for r in status.replicas if r.state == "ready"]
        assert len(nodes) == 2 and len(set(nodes)) == 2, nodes
        assert head_node_id() not in nodes  # the head has no GPUs
        assert status.placement == "spread"
    finally:
        remove(manager, "spread")


def test_pack_puts_replicas_on_one_node_while_it_has_room(cluster, manager):
    status = deploy(manager, spec("packed", replicas=2, placement="pack"))
    try:
        nodes = [r.node_id for r in status.replicas if r.state == "ready"]
        assert len(nodes) == 2 and len(set(nodes)) == 1, nodes
    finally:
        remove(manager, "packed")


def test_a_two_gpu_replica_has_both_gpus_on_one_node(cluster, manager):
    status = deploy(manager, spec("tp2", gpus=2))
    try:
        (replica,) = status.replicas
        assert len(replica.gpu_ids) == 2, replica  # two GPUs, as Ray gave them to one actor on one node
        assert replica.node_id in cluster.worker_node_ids()
    finally:
        remove(manager, "tp2")


def stream_until_done(client: Client, name: str, max_tokens: int, outcome: list) -> None:
    """Stream a completion; ``outcome`` gets ("ok", finish_reason, completion tokens, the arrival
    time of each text chunk) or ("error", when, why)."""
    try:
        chunks = client.stream_complete(name, "hi", max_tokens=max_tokens, ignore_eos=True,
                                        stream_options={"include_usage": True})
        finish, used, times = None, None, []
        for chunk in chunks:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
                if chunk.choices[0].text:
                    times.append(time.monotonic())
        outcome.append(("ok", finish, used, times))
    except Exception as exc:  # noqa: BLE001 - what failed, and when, is the result
        outcome.append(("error", time.monotonic(), f"{type(exc).__name__}: {exc}"))


def test_a_lost_worker_node_is_replaced_and_its_streams_go_on_on_the_other(cluster, manager):
    dep = spec("survivor", replicas=2)
    status = deploy(manager, dep)
    client = Client(manager=manager)
    try:
        by_node = {r.node_id: r for r in status.replicas}
        assert len(by_node) == 2
        doomed_node = next(iter(by_node))
        doomed = by_node[doomed_node]

        # Long streams on both replicas (50 tokens/s each: 600 tokens is 12 s).
        outcomes: list[list] = [[] for _ in range(8)]
        threads = [
            threading.Thread(target=stream_until_done, args=(client, dep.name, 600, out), daemon=True)
            for out in outcomes
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every stream has started on some replica
            loads = [r.in_flight for r in ControlPlane(manager).status(dep.name).replicas if r.state == "ready"]
            if sum(loads) >= 8 and all(loads):
                break
            time.sleep(0.2)
        killed_at = time.monotonic()
        cluster.kill_worker(doomed_node)

        # Requests sent while the node is gone are served by the surviving replica.
        for _ in range(3):
            done = client.complete(dep.name, "still there?", max_tokens=5)
            assert done.choices[0].text

        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        results = [out[0] for out in outcomes]
        # The streams were on both nodes (every replica had some); those on the lost one moved
        # to the other after what they had generated (serving.migration): none failed, each
        # ended whole.
        assert all(r[0] == "ok" and r[1] == "length" and r[2] == 600 for r in results), results
        # The gap across the loss: the moved streams' includes noticing the node gone and moving.
        gaps = sorted(b - a for r in results for a, b in zip(r[3], r[3][1:], strict=False) if a <= killed_at <= b)

        # The lost replica is replaced on the surviving node (a new replica's start takes minutes
        # on a busy 2-core machine).
        deadline = killed_at + 300
        while time.monotonic() < deadline:
            now = ControlPlane(manager).status(dep.name)
            ready = [r for r in now.replicas if r.state == "ready"]
            if len(ready) == 2 and doomed.replica_id not in {r.replica_id for r in ready}:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"not replaced within 300 s: {now}")
        replaced_in = time.monotonic() - killed_at
        print(f"\nnode lost -> replica replaced in {replaced_in:.1f} s; gap across the loss over "
              f"{len(gaps)} streams: p50 {gaps[len(gaps) // 2]:.2f} s, max {gaps[-1]:.2f} s")
        assert {r.node_id for r in ready} == set(cluster.worker_node_ids())
    finally:
        remove(manager, dep.name)
        client.close()
