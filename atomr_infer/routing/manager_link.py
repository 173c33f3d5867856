"""A ``Client``'s way to the manager: routing tables and demand reports (the ingress has
serve/table_cache.py, a long poll).

It holds the manager's handle, not the Client: a router given the Client's own bound method
kept the Client in a reference cycle, which a frozen heap (client.py) never collects. After a
failed call the manager is looked up again by name: one killed and made again (``atomr down``
of a cluster atomr did not start, then ``atomr deploy``) was otherwise never found, and every
new deployment was "not found" for good. A Ray error becomes atomr's ``RoutingError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from atomr_infer.errors import RoutingError, one_line
from atomr_infer.routing.table import RoutingTable

# How long the manager may take to answer for the routing table (it answers in milliseconds):
# a hung or unreachable manager fails the request, or leaves it routed by the cached table.
TABLE_FETCH_TIMEOUT_S = 5.0
RECOVERY_POLL_S = 1.0  # how long one ask waits while a restarted manager recovers


def lookup_manager() -> Any:
    """The manager's handle, by its name (blocks on the GCS)."""
    import ray

    from atomr_infer.cluster import MANAGER_NAME, NAMESPACE

    return ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)


class ManagerLink:
    def __init__(self, handle: Any, recovery_wait_s: float, lookup: Callable[[], Any] = lookup_manager) -> None:
        self._handle, self._lookup, self._recovery_wait_s = handle, lookup, recovery_wait_s

    async def table(self, since_version: int) -> RoutingTable | None:
        """The manager's table if it differs from ``since_version``. With none yet (``-1``), a
        restarted manager's answer while it recovers its deployments (None) is waited out, up to
        ``recovery_wait_s``: taken as an empty table, every deployment was "not found"."""
        deadline = time.monotonic() + self._recovery_wait_s
        while True:
            wait = RECOVERY_POLL_S if since_version < 0 else 0.0
            table = await self._ask(since_version, wait)
            if table is not None or since_version >= 0:
                return table
            if time.monotonic() >= deadline:
                raise RoutingError("the atomr manager restarted and is still recovering its deployments; retry shortly")

    async def _ask(self, since_version: int, wait_s: float) -> RoutingTable | None:
        try:
            if self._handle is None:
                self._handle = await asyncio.to_thread(self._lookup)  # blocks on the GCS: off the loop
            return await asyncio.wait_for(self._handle.routing_table.remote(since_version, wait_s),
                                          TABLE_FETCH_TIMEOUT_S + wait_s)
        except asyncio.TimeoutError:
            raise RoutingError(f"the atomr manager did not answer within {TABLE_FETCH_TIMEOUT_S:g}s") from None
        except Exception as exc:  # noqa: BLE001 - a Ray error (died, restarting, not found): looked up again
            self._handle = None
            raise RoutingError(f"the atomr manager is unavailable: {one_line(exc)}") from None

    def demand(self, *args: Any) -> None:
        """Report requests waiting for a replica (fire and forget; none before a handle is had)."""
        if self._handle is not None:
            self._handle.report_demand.remote(*args)
