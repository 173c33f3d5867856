"""Route a request to a ready replica of the named deployment and stream its answer back.

A ``Router`` caches the manager's routing table (refreshed at most once per ``refresh_s``, and
whenever a replica turns out dead) and picks a replica from the request's ``RoutingFacts``
(wire.py; the policies: routing/picker.py), over one channel per replica (routing/channel.py).
``serving.max_concurrent`` is enforced by the replica (tokenizing is neither held to it nor
counted in it): one that is full answers ``ReplicaBusy`` and the request is routed again; with
every replica full, ``queue`` waits for a slot (unbounded unless ``queue_timeout_s``),
``reject`` raises ``CapacityExhausted``. A stored Responses-API response is served by the
replica holding it (routing/response_ids.py).

Without the manager, routing goes on with the cached table. A replica this router saw die or
drain leaves its picks at once, until the table drops it; one only unreachable, until a newer
table. A request not started yet is retried on another replica; a stream already sending moves
(routing/migration.py) or fails with ``EngineError``. A consumer that stops early cancels its
request on the replica, which aborts it in the engine; closing the router ends its requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.exceptions import RayError

from atomr_infer.errors import (
    AdapterFailed,
    AdapterNotFound,
    AdapterNotLoaded,
    AtomrError,
    CapacityExhausted,
    DeploymentNotFound,
    EngineError,
    EngineQueueFull,
    NoReadyReplica,
    RouterClosed,
)
from atomr_infer.log import get_logger
from atomr_infer.replica_calls import Failure, replica_failure
from atomr_infer.routing import adapters, migration, response_ids
from atomr_infer.routing.channel import EngineGone, ReplicaChannel
from atomr_infer.routing.demand import Demand, DemandReport
from atomr_infer.routing.picker import PromptIds, ReplicaPicker
from atomr_infer.routing.policy import pick_replica
from atomr_infer.routing.prefix import prompt_key
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.task_context import outside_request
from atomr_infer.wire import NO_LIMIT, HttpHead, HttpRequest, OpenRequest, RoutingFacts

# fetch(since_version) -> a newer table, or None when ``since_version`` is current.
TableSource = Callable[[int], Awaitable[RoutingTable | None]]
TablePeek = Callable[[int], "RoutingTable | None"]  # the same, read at once from a local copy
# How long a request waits for a newer routing table when a cached one exists and no local copy
# is peeked (a healthy manager answers in milliseconds; one blocked on an absent GCS may not).
STALE_TABLE_WAIT_S = 0.25
# Tries for one request that fails before its first chunk (each on a replica not yet tried).
MAX_ATTEMPTS = 4
# How long a request waits for a LoRA adapter a replica is loading (a Hub repo is fetched first).
ADAPTER_LOAD_WAIT_S = 60.0
log = get_logger(__name__)


class Router:
    def __init__(
        self,
        source: TableSource,
        wait_for_replica_s: float = 30.0,
        refresh_s: float = 1.0,
        queue_timeout_s: float | None = None,
        demand: DemandReport | None = None,
        fresh_source: TableSource | None = None,
        peek: TablePeek | None = None,
    ) -> None:
        """``fresh_source``: asks the manager itself, for a forced refresh (a name the table lacks,
        a replica found dead) when ``source`` is a local copy kept by long poll (the ingress's): a
        deployment applied a moment ago is found, not 404. ``peek``: that copy read at once
        (``LookupError`` while it has none): a refresh not forced costs no turn of the event loop."""
        self._source = source
        self._fresh_source = fresh_source or source
        self._peek = peek
        self.id = uuid.uuid4().hex[:12]
        self._demand = Demand(self.id, demand)  # requests waiting or refused, told the manager (demand.py)
        self._picker = ReplicaPicker()
        self.migrations: collections.Counter[tuple[str, str]] = collections.Counter()  # (deployment, reason)
        self._wait_s, self._refresh_s = wait_for_replica_s, refresh_s
        # How long a request may wait for a free slot with on_capacity_exhausted=queue;
        # None waits as long as it takes (Ray Serve's default: unbounded queue).
        self._queue_timeout_s = queue_timeout_s
        self._table = RoutingTable(version=-1)
        self._fetched_at = 0.0
        self._refreshing: dict[bool, asyncio.Future[None]] = {}  # force -> the fetch running
        self._background: asyncio.Task[RoutingTable] | None = None  # a refresh no request waits for
        self._background_since = 0.0
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._released = asyncio.Event()
        self._excluded: dict[str, int | None] = {}  # actor name -> the table version it was excluded at, or None
        self._channels: dict[str, ReplicaChannel] = {}  # actor name -> its channel
        self._retired: list[ReplicaChannel] = []  # channels of unlisted replicas, until their requests end
        self._closed = False  # aclose()d: opens no channel again

    @property
    def table(self) -> RoutingTable:
        return self._table

    @property
    def route_reasons(self) -> collections.Counter[tuple[str, str]]:
        """How many requests this router routed for each (deployment, reason)."""
        return self._picker.reasons

    def load(self, actor_name: str) -> int:
        """Requests open on the replica as far as this router knows (its own at least)."""
        channel = self._channels.get(actor_name)
        return max(self._in_flight[actor_name], channel.said()[0] if channel is not None else 0)

    def _prefill_waiting(self, actor_name: str) -> int:
        """kv_events: blocks of prefill waiting on the replica, from every router, by its word."""
        channel = self._channels.get(actor_name)
        return channel.said()[1] if channel is not None else 0

    def _channel(self, route: ReplicaRoute) -> ReplicaChannel:
        if self._closed:  # no new channel (and its tasks) after aclose()
            raise RouterClosed("the router was closed")
        channel = self._channels.get(route.actor_name)
        if channel is None or channel.error is not None:
            channel = self._channels[route.actor_name] = ReplicaChannel(route.actor, self._released.set)
        return channel

    async def aclose(self) -> None:
        """Close every channel of this router and wait for their tasks (before their event loop closes)."""
        self._closed = True
        self._released.set()  # a request waiting for a replica: it ends now (RouterClosed)
        channels = [*self._channels.values(), *self._retired]
        tasks = [task for channel in channels for task in channel.close()]
        if self._background is not None and self._background.cancel():  # a table fetch under way
            tasks.append(self._background)
        self._channels.clear()
        self._retired.clear()
        self._picker.close()  # the KV events it followed
        await asyncio.gather(*tasks, return_exceptions=True)

    async def refresh(self, force: bool = False) -> RoutingTable:
        """The routing table, fetched again if ``force`` or older than ``refresh_s``. One fetch at a
        time of each kind: requests that arrive meanwhile wait for it (1,024 at once made 1,024
        calls). A table only old is waited for at most ``STALE_TABLE_WAIT_S``, then routed by while
        the fetch goes on (a manager restarting holds no request up). With ``peek``, a refresh not
        forced reads the local copy and waits for nothing."""
        if not force and self._peek is not None and self._table.version >= 0:
            with contextlib.suppress(LookupError):
                self._adopt(self._peek(self._table.version))
                return self._table
        if not force and self._table.version >= 0:
            if time.monotonic() - self._fetched_at >= self._refresh_s:
                task = self._background
                if task is None or task.done():
                    task = self._background = outside_request(
                        asyncio.get_running_loop().create_task, self._refresh(False)
                    )
                    self._background_since = time.monotonic()
                # Only the first requests wait: once the manager is late, the rest route at once.
                wait = STALE_TABLE_WAIT_S - (time.monotonic() - self._background_since)
                if wait > 0:
                    await asyncio.wait({task}, timeout=wait)
            return self._table
        while (running := self._refreshing.get(force)) is not None:
            await asyncio.shield(running)  # resolved however that fetch ended
            if self._table.version >= 0:
                return self._table
            # It failed with nothing cached: try (and fail) in turn, not all at once.
        if not force and time.monotonic() - self._fetched_at < self._refresh_s:
            return self._table
        return await self._refresh(force)

    async def _refresh(self, force: bool) -> RoutingTable:
        done = self._refreshing[force] = asyncio.get_running_loop().create_future()
        try:
            return await self._fetch(force)
        finally:
            del self._refreshing[force]
            done.set_result(None)

    async def _fetch(self, force: bool) -> RoutingTable:
        try:
            newer = await (self._fresh_source if force else self._source)(self._table.version)
        except Exception as exc:  # noqa: BLE001 - the manager is down or restarting
            if self._table.version < 0:
                raise  # nothing cached: nothing to route by
            # Keep routing by the cached table: replicas serve while the manager restarts.
            log.warning("routing_table_refresh_failed", error=f"{type(exc).__name__}: {exc}")
            newer = None
        self._adopt(newer)
        return self._table

    def _adopt(self, newer: RoutingTable | None) -> None:
        """Route by ``newer`` from now on (``None``: the table is still current)."""
        self._fetched_at = time.monotonic()
        if newer is not None:
            self._table = newer.keeping(self._table)  # a deployment not recovered yet: as it was
            self._forget_exclusions(self._table)
            self._picker.table_changed(self._table)

    def exclude(self, actor_name: str, permanent: bool) -> None:
        """Stop picking ``actor_name``: for good (dead, draining) or until a newer table."""
        self._excluded[actor_name] = None if permanent else self._table.version
        log.info("replica_excluded", replica=actor_name, permanent=permanent)

    def _forget_exclusions(self, table: RoutingTable) -> None:
        listed = {r.actor_name for dep in table.deployments.values() for r in dep.replicas}
        for name, version in list(self._excluded.items()):
            if name not in listed or (version is not None and table.version != version):
                del self._excluded[name]
        self._retired = [c for c in self._retired if not c.retired_and_closed]
        for name in [n for n in self._channels if n not in listed]:
            channel = self._channels.pop(name)
            channel.retire()
            self._retired.append(channel)

    async def _route(
        self, facts: RoutingFacts, model: str = ""
    ) -> tuple[DeploymentRoute, ReplicaRoute, str | None, int]:
        """The deployment, replica and LoRA adapter for ``facts`` (waiting for a replica if need be), and
        the prefill blocks it queued there (kv_events); ``model``: a moved stream's, the one it began on."""
        name = facts.deployment
        started = appear_from = time.monotonic()  # the wait for a ready replica runs from appear_from
        queue_deadline = None if self._queue_timeout_s is None else started + self._queue_timeout_s
        table = await self.refresh()
        forced = False
        if not table.knows(name):
            table, forced = await self.refresh(force=True), True
        waiting_for: str | None = None  # the deployment this request is counted waiting for
        keys: list[Any] = []  # the request's prefix key, read once however long it waits
        tokens: list[PromptIds | None] = []  # kv_events: its token ids (and whose tokenizer's), likewise

        def key() -> Any:
            if not keys:
                keys.append(prompt_key(facts.prompt, salt=facts.cache_salt))
            return keys[0]

        try:
            while True:
                dep, adapter = table.resolve(name)
                if dep is None:
                    raise DeploymentNotFound(name, sorted(table.deployments), table.adapter_of(name))
                if adapter is not None and adapter not in dep.adapters:
                    if not forced:  # added by an apply this router's table has not seen yet?
                        table, forced = await self.refresh(force=True), True
                        continue
                    raise AdapterNotFound(dep.name, adapter, dep.adapters)
                # An adapter's requests go where it is loaded (a replica loading it waits its turn).
                usable = [
                    r for r in dep.replicas
                    if r.actor_name not in self._excluded and (adapter is None or adapter in r.adapters)
                ]
                if adapter is not None and not usable and (why := adapters.failed_everywhere(
                        dep.replicas, adapter, self._excluded)) is not None:
                    raise AdapterFailed(dep.name, adapter, why)
                if model:
                    usable = migration.on_model(usable, dep, model, self._excluded)
                if facts.response_id is not None:
                    usable = response_ids.holding(usable, dep.name, facts.response_id, dep.replicas, self._excluded)
                if usable:
                    if not facts.kind.runs_engine:  # tokenizing: not held to max_concurrent
                        loads = {r.actor_name: self.load(r.actor_name) for r in usable}
                        return dep, pick_replica(usable, loads, NO_LIMIT), adapter, 0  # type: ignore[return-value]
                    if not tokens or (tokens[0] is None and dep.policy == "kv_events"):
                        tokens[:] = [await self._picker.prompt_tokens(dep, usable, facts)]
                    loads = {r.actor_name: self.load(r.actor_name) for r in usable}  # after the wait: current
                    choice = self._picker.pick(dep, usable, loads, key, adapter, tokens[0], self._prefill_waiting)
                    if choice is not None:
                        return dep, choice, adapter, self._picker.take_work(choice.actor_name)
                    if dep.on_capacity_exhausted == "reject":
                        self._demand.refused(dep.name, time.monotonic())
                        raise CapacityExhausted(name, dep.max_concurrent)
                if self._closed:
                    raise RouterClosed("the router was closed")
                now = time.monotonic()
                # An adapter a replica is loading is waited for as long as loading may take, and is no
                # demand (more replicas would load it too); a deployment that may scale to zero, a start.
                loading = adapter is not None and any(
                    adapter in r.adapters_loading and r.actor_name not in self._excluded for r in dep.replicas)
                if not facts.wakes:  # may start none (no key): none may come of a deployment at zero
                    if not usable and dep.cold_start_timeout_s is not None:
                        raise NoReadyReplica(name, now - started)
                elif usable or not loading:
                    if waiting_for is None:
                        waiting_for = dep.name
                        self._demand.wait(dep.name)
                    self._demand.report(dep.name, now)
                if usable:  # all full: queue for a slot
                    appear_from = now  # replicas exist; that wait is not running
                    if queue_deadline is not None and now >= queue_deadline:
                        self._demand.refused(dep.name, now)
                        raise CapacityExhausted(name, dep.max_concurrent, retry_after_s=1.0)
                patience = max(self._wait_s, dep.cold_start_timeout_s or 0.0, ADAPTER_LOAD_WAIT_S if loading else 0.0)
                remaining = appear_from + patience - now
                if remaining <= 0:
                    ready = [r for r in dep.replicas if r.actor_name not in self._excluded]
                    if adapter is not None and ready and not any(adapter in r.adapters for r in ready):
                        raise AdapterNotLoaded(dep.name, adapter, len(ready), now - started, loading)
                    raise NoReadyReplica(name, now - started)
                # Wait for a slot to free up or for the table to change, whichever comes first.
                self._released.clear()
                try:
                    await asyncio.wait_for(self._released.wait(), timeout=min(remaining, 0.25))
                except asyncio.TimeoutError:
                    table = await self.refresh(force=not usable)
        finally:
            if waiting_for is not None:
                self._demand.waited(waiting_for, time.monotonic())

    async def stream(self, facts: RoutingFacts, request: HttpRequest) -> AsyncIterator[HttpHead | bytes]:
        """The replica's answer to ``request`` (an ``HttpHead``, then body bytes), routed by
        ``facts`` (the deployment it names, its prefix, …). A resumable stream whose replica
        dies goes on on another (routing/migration.py)."""
        name = facts.deployment
        attempt = moved = crashed = 0  # crashed: engines that failed under it (a request may crash them)
        generated: list[int] = []  # token ids a resumable stream generated, as the replicas report them
        resume: list[int] | None = None  # set once it moved: continue after these
        sent, last = False, b""  # anything sent to the caller, by any replica; the last body bytes
        failed_at, began_on = 0.0, ""  # began_on: the model its tokens came from (moved: only on that one)
        if facts.resumable and not facts.named:  # the body's request_id names its chunks on any replica
            request = migration.named(request)
        while True:
            dep, route, adapter, work = await self._route(facts, began_on if resume is not None else "")
            attempt += 1
            last_try = attempt >= MAX_ATTEMPTS
            counted = facts.kind.runs_engine  # tokenizing: neither held to max_concurrent nor counted in it
            self._in_flight[route.actor_name] += counted
            sent_request = adapters.by_full_name(request, name, dep.name, adapter)
            if facts.names_response:
                sent_request = response_ids.with_request_id(sent_request, response_ids.mint(dep.name, route.replica_id))
            want = bool(facts.resumable) and dep.migration_tries > 0
            limit = dep.max_concurrent if counted else NO_LIMIT
            opening = OpenRequest("", sent_request, limit, adapter, want, resume, work)
            prefilled = self._picker.answer_once(route.actor_name, work)  # also what the replica says
            items = self._channel(route).request(opening, generated if want else None, prefilled)
            sent_here = finished = False
            try:
                retry = None if last_try else (route.actor_name, dep.max_concurrent)  # a continuation's 503
                answer = items if resume is None else migration.seam(facts.kind, items, bool(last), retry)
                async for chunk in answer:
                    if isinstance(chunk, HttpHead) and chunk.status == 503 and not sent and not last_try:
                        await items.aclose()  # vLLM's queue is full: "retry on a different instance"
                        raise EngineQueueFull(route.actor_name, dep.max_concurrent)
                    if work and not isinstance(chunk, HttpHead):  # its first output: its prefill is done
                        prefilled()
                        work = 0
                    if failed_at:
                        migration.log_moved(dep.name, route.actor_name, failed_at, len(generated))
                        failed_at = 0.0
                    began_on = began_on or route.model
                    sent = sent_here = True
                    last = last if isinstance(chunk, HttpHead) else chunk
                    yield chunk
                finished = True
                return
            except (RayError, ConnectionError, AtomrError) as exc:
                finished = True
                failure = replica_failure(exc)  # replica_calls.py: the one translation
                crashed += isinstance(exc, EngineGone)
                if crashed > 1:  # moved or re-run once: not a third engine
                    raise EngineError(f"the engines of two replicas failed under this request: {exc}") from None
                if failure.kind in (Failure.DEAD, Failure.UNREACHABLE):
                    # Unreachable may come back; dead never serves again.
                    self.exclude(route.actor_name, permanent=failure.kind is Failure.DEAD)
                    if facts.resumable and (end := migration.end_of(last)) is not None:  # only its end was lost
                        if end:
                            yield end
                        return
                    again = resume is not None and not sent_here  # a continuation died before its output
                    if sent and (again and not last_try or migration.can_move(facts, dep, moved, len(generated))):
                        if not again:
                            moved, attempt = moved + 1, attempt - 1  # moves have their own bound (max_tries)
                            self.migrations[dep.name, failure.kind.value] += 1
                            self._picker.metrics.migrated(dep.name, failure.kind.value)
                        resume, failed_at = list(generated), failed_at or time.monotonic()
                    elif sent or last_try:
                        raise EngineError(f"replica {route.actor_name} died mid-request: {exc}") from None
                elif failure.kind is Failure.BUSY and not sent_here:
                    attempt -= not isinstance(failure.cause, EngineQueueFull)  # full, not failed: route again
                    self._channel(route).note_full(failure.cause.limit)  # type: ignore[attr-defined]
                elif failure.kind is Failure.UNAVAILABLE and not sent_here:
                    self.exclude(route.actor_name, permanent=True)  # draining or stopped
                    if last_try:
                        raise failure.cause from None
                else:
                    raise failure.cause from None
            finally:
                prefilled()
                self._in_flight[route.actor_name] -= counted
                self._released.set()
                if not finished:  # consumer went away or was cancelled: abort in the engine
                    await items.aclose()
            log.info("request_retried", deployment=name, replica=route.actor_name, attempt=attempt, moved=moved)
            await self.refresh(force=True)

