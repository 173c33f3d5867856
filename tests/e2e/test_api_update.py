"""The API updated in place (``atomr serve`` again, ``atomr up --serve`` with new settings) under
traffic: every deploy restarts the ingress replicas, and no connection is refused meanwhile (the
new replica binds the port before the old one stops; serve/server.py ``_surge``)."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.conftest import REPLICA_WAIT_S

pytestmark = pytest.mark.e2e


def test_updating_the_api_in_place_refuses_no_connection(openai_server, ray_cluster):
    from atomr_infer.serve import run_server

    url = urlsplit(openai_server.url)
    before = _ingress_replicas()
    assert before, "no ingress replica found"
    refused: list[str] = []
    answered = [0]
    stop = threading.Event()

    def callers() -> None:  # a new connection each time: what a refusal would hit
        while not stop.is_set():
            try:
                httpx.get(f"{openai_server.url}/health", timeout=30)
                answered[0] += 1
            except httpx.TransportError as exc:
                refused.append(repr(exc))
            time.sleep(0.01)

    thread = threading.Thread(target=callers, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        run_server(url.hostname, url.port, ray_cluster.get_runtime_context().gcs_address, blocking=True,
                   replica_wait_s=REPLICA_WAIT_S)  # the same settings: the replicas restart all the same
        deadline = time.monotonic() + 60  # until the old replica has stopped (its drain is ~2 s)
        while before & _ingress_replicas() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join(60)
    assert not before & _ingress_replicas(), "the ingress was not replaced"
    assert answered[0] > 20
    assert not refused, refused[:3]


def _ingress_replicas() -> set[str]:
    """The names of the API's live ingress replicas (Serve names its replica actors after the app)."""
    import ray

    from atomr_infer.serve.server import APP_NAME

    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in named if a["name"].startswith("SERVE_REPLICA::") and APP_NAME in a["name"]}
