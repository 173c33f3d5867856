"""Autoscaling on the loopback cluster: up with load, down after the delay without failed
requests, and from zero on the first request. The engine is the emulated one (a fixed 20 ms
step), so "long requests" last as long as the test says on any CPU; the replicas report their
real in-flight counts and the routers their real waiting requests."""

from __future__ import annotations

import threading
import time

import pytest

from atomr_infer.client import Client
from atomr_infer.control.client import ControlPlane
from tests.multinode.test_multinode import deploy, remove, spec
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
UP_S, DOWN_S = 2.0, 5.0


def load(client: Client, name: str, stop: threading.Event, served: list, failed: list) -> None:
    while not stop.is_set():
        try:
            chunks = client.stream_complete(name, "load", max_tokens=100, ignore_eos=True)  # 2 s each
            served.append("".join(c.choices[0].text for c in chunks if c.choices).count(" go"))  # one per token
        except Exception as exc:  # noqa: BLE001 - every failure is counted
            failed.append(f"{type(exc).__name__}: {exc}")


def wait_for(what, predicate, timeout_s: float, cp: ControlPlane, name: str):
    """The deployment's status once ``predicate`` holds of it."""
    return wait_until(lambda: (lambda s: s if predicate(s) else None)(cp.status(name)), timeout_s, 0.25, what)


def ready(status) -> int:
    return sum(1 for r in status.replicas if r.state == "ready")


def test_scales_up_under_load_and_back_down_after_the_delay(manager):
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4,
               "upscale_delay_s": UP_S, "downscale_delay_s": DOWN_S, "look_back_period_s": 1.0}
    dep = spec("elastic", autoscaling=scaling)
    began = time.monotonic()
    deploy(manager, dep)
    start_s = time.monotonic() - began  # one replica's start, for the bound below
    cp, client = ControlPlane(manager), Client(manager=manager)
    stop, served, failed = threading.Event(), [], []
    threads = [threading.Thread(target=load, args=(client, dep.name, stop, served, failed), daemon=True)
               for _ in range(16)]
    try:
        loaded_at = time.monotonic()
        for t in threads:
            t.start()
        # 16 in flight over a target of 4 each: 2 replicas (the max), once the load held UP_S.
        status = wait_for("a second ready replica", lambda s: ready(s) == 2, UP_S + 2 * start_s + 30, cp, dep.name)
        up_s = time.monotonic() - loaded_at
        decision = status.autoscaling["last_decision"]
        assert (decision["from_replicas"], decision["to_replicas"]) == (1, 2), decision
        assert "load" in decision["reason"]

        stop.set()
        for t in threads:
            t.join(30)
        stopped_at = time.monotonic()
        status = wait_for("back to one replica", lambda s: s.replicas_desired == 1 and ready(s) == 1,
                          DOWN_S + 30, cp, dep.name)
        down_s = time.monotonic() - stopped_at
        print(f"\nreplica start {start_s:.1f} s; second replica ready {up_s:.1f} s after the load began "
              f"(upscale_delay_s {UP_S:g}); back to one {down_s:.1f} s after it stopped (downscale_delay_s {DOWN_S:g})")
        assert down_s >= DOWN_S - 1.0  # not before the delay (less the load's last requests ending)
        assert status.autoscaling["last_decision"]["to_replicas"] == 1
        assert not failed, failed[:3]
        assert len(served) >= 16 and all(n == 100 for n in served)
    finally:
        stop.set()
        remove(manager, dep.name)
        client.close()


def test_scales_to_zero_and_serves_the_first_request_after(manager):
    scaling = {"min_replicas": 0, "max_replicas": 1, "downscale_delay_s": 3.0, "look_back_period_s": 1.0,
               "cold_start_timeout_s": 120.0}
    dep = spec("sleepy", replicas=0, autoscaling=scaling)
    cp, client = ControlPlane(manager), Client(manager=manager)
    try:
        status = deploy(manager, dep)
        assert status.replicas_desired == 0 and not status.replicas and status.state == "idle"
        seen: list[str] = []
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                seen.append(str(cp.status(dep.name).state))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        asked_at = time.monotonic()
        answer = client.complete(dep.name, "wake up", max_tokens=5)
        cold_s = time.monotonic() - asked_at
        watching.set()
        watcher.join(5)
        assert answer.choices[0].text
        assert "cold-start" in seen, seen  # visible in status while it waited
        status = cp.status(dep.name)
        assert status.autoscaling["last_decision"]["reason"].startswith("cold start")
        idle = wait_for("scaled back to zero", lambda s: s.state == "idle" and not ready(s), 30, cp, dep.name)
        print(f"\ncold start served the first request in {cold_s:.1f} s; idle again: {idle.state}")
    finally:
        remove(manager, dep.name)
        client.close()
