"""The ingress's copy of the manager's routing table, kept current by a long poll.

A background task asks the manager ``routing_table(version, timeout_s)``; the manager answers
as soon as the table changes (or after the timeout with ``None``). So a request never waits on
a manager round trip: ``get`` only reads the local copy. The task holds the cache, not the
ingress that owns it, and survives manager restarts (it retries with a pause).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.routing.manager_link import lookup_manager
from atomr_infer.routing.table import RoutingTable
from atomr_infer.serve.errors import ManagerUnreachable
from atomr_infer.task_context import outside_request

log = get_logger(__name__)
POLL_TIMEOUT_S = 30.0
RETRY_PAUSE_S = 1.0
FIRST_LOAD_TIMEOUT_S = 10.0
FETCH_TIMEOUT_S = 5.0


class TableCache:
    def __init__(
        self,
        lookup: Callable[[], Any] | None = None,
        poll_timeout_s: float = POLL_TIMEOUT_S,
        first_load_timeout_s: float = FIRST_LOAD_TIMEOUT_S,
    ) -> None:
        self._lookup = lookup or lookup_manager
        self._handle: Any = None
        self._looking: asyncio.Future[Any] | None = None  # the lookup under way
        self._poll_timeout_s, self._first_load_timeout_s = poll_timeout_s, first_load_timeout_s
        self._last_error = ""
        self._table = RoutingTable(version=-1)
        self._loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def manager(self) -> Any:
        """The manager actor handle, looked up by name once and again after a failed call. The
        lookup (``ray.get_actor``) blocks on the GCS (up to 60 s while it is away): it runs in
        a thread, never on the event loop that serves every stream of the ingress."""
        if self._handle is None:
            # One lookup at a time, shared (and shielded: a caller's timeout leaves it running for
            # the next): each blocked lookup holds a thread of the loop's default executor, which
            # the router's tokenizing shares; a probe a second would fill it while the GCS is away.
            if self._looking is None or self._looking.done():
                self._looking = asyncio.ensure_future(asyncio.to_thread(self._lookup))
                self._looking.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: not logged
            self._handle = await asyncio.shield(self._looking)
        return self._handle

    def cached_manager(self) -> Any:
        """The handle if one is cached, at once (fire-and-forget calls): else ``LookupError``."""
        if self._handle is None:
            raise LookupError("the manager has not been looked up yet")
        return self._handle

    def forget_manager(self) -> None:
        """Drop the cached handle after a failed call, so the next call looks it up again."""
        self._handle = None

    @property
    def table(self) -> RoutingTable:
        return self._table

    def start(self) -> None:
        """Start the poll on the running loop (idempotent; restarted if it ever ended).

        The task runs in a fresh context: started from inside a request, it would otherwise
        inherit that request's Ray task context, and Ray cancels a task's calls (this poll's
        too) when the request is cancelled, e.g. by a client hanging up.
        """
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = outside_request(loop.create_task, self._poll())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def get(self, since_version: int) -> RoutingTable | None:
        """A ``Router`` table source: the local table if it differs from ``since_version``."""
        self.start()
        if not self._loaded.is_set():
            try:
                await asyncio.wait_for(self._loaded.wait(), self._first_load_timeout_s)
            except asyncio.TimeoutError:
                raise ManagerUnreachable(self._last_error or "no routing table yet") from None
        return self.peek(since_version)

    def peek(self, since_version: int) -> RoutingTable | None:
        """What ``get`` answers, at once: ``LookupError`` while no table has come yet."""
        self.start()
        if not self._loaded.is_set():
            raise LookupError("no routing table yet")
        return self._table if self._table.version != since_version else None

    async def fetch(self, since_version: int) -> RoutingTable | None:
        """Ask the manager now, not the local copy (which lags it by the long poll's round
        trip): the table if it differs from ``since_version``, and the cache takes it too."""
        try:
            newer = await asyncio.wait_for(self._ask(since_version, 0.0), FETCH_TIMEOUT_S)
        except Exception:
            self._handle = None  # look it up again next time: it may have been re-created
            raise
        if newer is not None:
            self._take(newer)
        return newer

    async def _ask(self, since_version: int, timeout_s: float) -> RoutingTable | None:
        return await (await self.manager()).routing_table.remote(since_version, timeout_s)

    def _take(self, newer: RoutingTable) -> None:
        # Any table that differs is taken ("different", not "higher"): a restarted manager starts
        # its versions from the clock (control/manager.py), and a clock can step back.
        self._table = newer
        self._loaded.set()
        log.debug("routing_table_updated", version=newer.version, deployments=sorted(newer.deployments))

    async def _poll(self) -> None:
        while True:
            try:
                newer = await self._ask(self._table.version, self._poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the manager may be restarting; keep serving the old table
                self._handle = None  # look it up again: it may have been re-created
                self._last_error = repr(exc)
                log.warning("routing_table_poll_failed", error=self._last_error)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if newer is not None:
                self._take(newer)

