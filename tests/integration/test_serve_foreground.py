"""What a foreground ``atomr serve`` leaves in Ray's KV for ``stop_server`` elsewhere
(serve/server.py), on the session's real cluster. The whole behaviour (``atomr down`` beside a
foreground ``atomr serve``; a head whose GCS is killed) runs in tests/e2e/test_cli.py. Other
foreground servers may hold the API on this cluster meanwhile (the e2e tier's ``atomr serve``),
so these tests look at their own holds only."""

from __future__ import annotations

import time

from atomr_infer.cluster import NAMESPACE
from atomr_infer.serve import server


def test_a_hold_counts_until_released(ray_cluster):
    mine = server._foreground_key()
    assert mine not in server.foreground_holders()
    server.hold_foreground(True)
    try:
        assert mine in server.foreground_holders()
    finally:
        server.hold_foreground(False)
    assert mine not in server.foreground_holders()


def test_a_hold_not_renewed_is_left_out(ray_cluster):
    """A foreground server killed without letting go: its hold goes stale, and a stop elsewhere
    does not wait for it."""
    from ray.experimental import internal_kv

    key = f"{server._FOREGROUND_PREFIX}test-host:1"
    said = time.time() - server.FOREGROUND_STALE_S - 1
    internal_kv._internal_kv_put(key, str(said), overwrite=True, namespace=NAMESPACE)
    try:
        assert key not in server.foreground_holders()
        internal_kv._internal_kv_put(key, str(time.time()), overwrite=True, namespace=NAMESPACE)
        assert key in server.foreground_holders()
    finally:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def test_a_cluster_that_answers_is_not_gone(ray_cluster):
    assert server.cluster_gone() is None
