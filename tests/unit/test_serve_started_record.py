"""Whether atomr started Serve for the API is recorded with it, so an update in place keeps it.

``atomr up --serve`` on a cluster the user started started Serve; ``atomr serve`` then updated
the API in place, found Serve running and took it for someone else's, so its Ctrl-C deleted the
API but left Serve's detached controller, which ``atomr down`` (no API recorded any more) left
too. Ray's KV and Serve are faked here: a dict and a set of application names.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture
def cluster(monkeypatch):
    """A cluster with no API on it; ``.serve_running`` says whether Serve runs."""
    from ray import serve
    from ray.experimental import internal_kv

    from atomr_infer import cluster as cluster_module
    from atomr_infer.control import client
    from atomr_infer.serve import listener, server

    kv: dict[str, str] = {}
    apps: set[str] = set()
    state = SimpleNamespace(serve_running=False)

    def start_serve() -> bool:
        if state.serve_running:
            return False
        state.serve_running = True
        return True

    def shutdown_serve() -> None:
        state.serve_running = False
        apps.clear()

    monkeypatch.setattr(internal_kv, "_internal_kv_put", lambda k, v, overwrite=True, namespace=None: kv.update({k: v}))
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k, namespace=None: kv.get(k))
    monkeypatch.setattr(internal_kv, "_internal_kv_del", lambda k, namespace=None: kv.pop(k, None))
    monkeypatch.setattr(cluster_module, "connect", lambda address=None, start=True: None)
    monkeypatch.setattr(client, "manager_handle", lambda address=None, start=True: None)
    monkeypatch.setattr(listener, "check_free", lambda host, port: None)
    monkeypatch.setattr(server, "_this_node", lambda: {})
    monkeypatch.setattr(server, "_serve_running", lambda: state.serve_running)
    monkeypatch.setattr(server, "_start_serve", start_serve)
    monkeypatch.setattr(server, "_shutdown_serve", shutdown_serve)
    monkeypatch.setattr(server, "_wait_foreground_left", lambda timeout_s: None)
    monkeypatch.setattr(server, "_stop_rate_limiter", lambda: None)
    monkeypatch.setattr(serve, "_run", lambda app, name, **kw: apps.add(name))
    monkeypatch.setattr(serve, "delete", lambda name: apps.discard(name))
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={name: None for name in apps}))
    return state


@pytest.mark.parametrize("serve_was_running", [False, True])
def test_stopping_an_api_updated_in_place_shuts_down_the_serve_atomr_started(cluster, serve_was_running):
    from atomr_infer.serve import server

    cluster.serve_running = serve_was_running  # True: the user's own Serve, to be left running
    server.run_server("127.0.0.1", 8000)  # `atomr up --serve`
    updated = server.run_server("127.0.0.1", 8000, max_body_bytes=1024)  # `atomr serve` over it
    assert server.running_server() is not None and updated.started_serve is not serve_was_running
    server.stop_server(updated)  # its Ctrl-C
    assert server.running_server() is None
    assert cluster.serve_running is serve_was_running
