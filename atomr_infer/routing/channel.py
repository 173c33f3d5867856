"""A router's end of a replica's channel (replica/channel.py): many requests, one stream.

``ReplicaChannel.request`` opens one request on the replica (``open_many``, which also admits
it, carrying every request this router opened there in the same turn of its event loop) and
yields what it produces; one task per channel reads the replica's ``channel`` stream and
hands each batch's items to the requests they belong to. Items that arrive while a consumer
is busy wait in its inbox, a ``MergingBuffer`` (merging.py) that joins consecutive body bytes,
so a slow consumer takes fewer, larger pieces. A consumer that leaves before the end cancels its request on the
replica (which aborts it in the engine within one step). If the channel's stream fails (the
replica died), every open request on it fails with that error, within the time Ray takes to
notice; the router drops the channel and opens a new one on the next request.

A channel is a lease on the replica (replica/channel.py): a second task renews it every
``KEEPALIVE_S``, so that the replica cancels the requests of a router whose process died.

The reading and renewing tasks, the batched opens and the cancel calls run outside the caller's
Ray task context (task_context.py): started from inside a request of the ingress, Ray would
cancel them with that request (a client hanging up).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from atomr_infer.errors import RouterClosed
from atomr_infer.merging import MergingBuffer, join_bytes
from atomr_infer.replica_calls import ReplicaCalls
from atomr_infer.task_context import outside_request
from atomr_infer.wire import KEEPALIVE_S, HttpHead, LastBytes, OpenRequest

# How long a replica's own word on its load counts (a router that sends it nothing hears nothing).
LOAD_FRESH_S = 1.0

Item = HttpHead | bytes


class _Inbox(MergingBuffer[Item]):
    """One request's items between the channel's reader and the request's consumer, and the
    token ids it generated (when it asked for them)."""

    __slots__ = ("token_ids", "prefilled")

    def __init__(self, token_ids: list[int] | None = None, prefilled: Callable[[], None] | None = None) -> None:
        super().__init__(join_bytes)  # type: ignore[arg-type]
        self.token_ids: list[int] = [] if token_ids is None else token_ids
        self.prefilled = prefilled  # told when the replica says its prompt is computed

    def _last(self, item: Item) -> Item:
        return LastBytes(item) if type(item) is bytes else item


def _stop(stream: Any) -> None:
    """Cancel the replica's channel stream (which cancels its requests there). A test's fake
    stream is none of Ray's: ``ray.cancel`` would start a local Ray for it."""
    if isinstance(stream, ray.ObjectRefGenerator):
        with contextlib.suppress(Exception):  # the replica or Ray gone too: its lease ends them
            ray.cancel(stream)


class EngineGone(ConnectionError):
    """The replica closed the channel because its engine failed: its requests move or re-run on
    another replica, as when a replica dies, but once only (a request may be what crashed it)."""


class ReplicaChannel:
    def __init__(self, actor: Any, on_load: Callable[[], None] = lambda: None) -> None:
        self._actor = ReplicaCalls(actor)
        self._on_load = on_load  # told whenever the replica says its load (a slot may have freed)
        self.channel_id = uuid.uuid4().hex
        self._inboxes: dict[str, _Inbox] = {}
        self._reader: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self.error: BaseException | None = None  # set once the stream failed: the channel is dead
        self.load: int | None = None  # the replica's open requests, as it last said
        self.prefill = 0  # kv_events: the blocks of prefill waiting there, as its last batch said
        self.load_at = self.prefill_at = 0.0
        self.batches = 0  # messages received (bench_dataplane reports items per message)
        self._retired = False  # no new requests; closes when its last one ends
        # Requests to open on the replica at the end of this turn of the event loop (_open).
        self._opening: list[tuple[OpenRequest, asyncio.Future[Any]]] = []
        self._sends: set[asyncio.Task[None]] = set()  # open_many calls awaited (kept from the GC)

    def _note_load(self, load: int, prefill: int | None = None) -> None:
        """``prefill``: None where the replica did not say it (an open's answer carries only the load)."""
        self.load, self.load_at = load, time.monotonic()
        if prefill is not None:
            self.prefill, self.prefill_at = prefill, self.load_at
        self._on_load()

    def said(self) -> tuple[int, int]:
        """(open requests, blocks of prefill waiting) on the replica by its last word, (0, 0) when
        that is older than ``LOAD_FRESH_S`` (a router that sends it nothing hears nothing)."""
        now = time.monotonic()
        load = 0 if self.load is None or now - self.load_at > LOAD_FRESH_S else self.load
        return load, 0 if now - self.prefill_at > LOAD_FRESH_S else self.prefill

    def note_full(self, limit: int) -> None:
        """The replica refused a request at its limit: count it as full until it says otherwise."""
        self.load, self.load_at = limit, time.monotonic()

    def _start_reader(self) -> None:
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._reader = outside_request(loop.create_task, self._read())
            self._renewer = outside_request(loop.create_task, self._renew())

    async def _renew(self) -> None:
        while self.error is None:
            await asyncio.sleep(KEEPALIVE_S)
            # A failure is the reader's to see (a dead replica ends the channel).
            with contextlib.suppress(Exception):
                await self._actor.keepalive(self.channel_id)

    async def _read(self) -> None:
        gen = None
        try:
            gen = self._actor.channel(self.channel_id)
            async for ref in gen:
                batch = await ref
                self.batches += 1
                self._note_load(batch.load, batch.prefill)
                for request_id, ids in batch.token_ids.items():
                    inbox = self._inboxes.get(request_id)
                    if inbox is not None:
                        inbox.token_ids.extend(ids)
                for request_id, items in batch.items.items():
                    inbox = self._inboxes.get(request_id)
                    if inbox is not None:
                        inbox.put_all(items)
                for request_id, error in batch.ended.items():
                    inbox = self._inboxes.get(request_id)
                    if inbox is not None:
                        inbox.end(error)
                for request_id in batch.prefilled:
                    inbox = self._inboxes.get(request_id)
                    if inbox is not None and inbox.prefilled is not None:
                        inbox.prefilled()
                if batch.engine_failed is not None:
                    raise EngineGone(f"the replica's engine failed ({batch.engine_failed}); it closed the channel")
            raise ConnectionError("the replica closed the channel")
        except asyncio.CancelledError:
            for inbox in self._inboxes.values():  # closed under open requests: they end, not hang
                inbox.end(RouterClosed("the router was closed under this request"))
            _stop(gen)
            raise
        except Exception as exc:  # noqa: BLE001 - the replica died or is unreachable
            self.error = exc
            if self._renewer is not None:
                self._renewer.cancel()
            for inbox in self._inboxes.values():
                inbox.end(exc)
            _stop(gen)  # a replica still alive (its batch lost on the way) stops what moves elsewhere

    def _open(self, request: OpenRequest) -> asyncio.Future[Any]:
        """Open one request on the replica, sent with every other request opened on this
        channel in the same turn of the event loop (one ``open_many`` call): resolves to the
        replica's load, or raises what the replica refused it with."""
        loop = asyncio.get_running_loop()
        opened = loop.create_future()
        if not self._opening:
            # Outside the caller's Ray task context, like the reader: the call serves many requests.
            outside_request(loop.call_soon, self._send_opens)
        self._opening.append((request, opened))
        return opened

    def _send_opens(self) -> None:
        # A request cancelled before this turn is not sent (so there is nothing to cancel).
        sending = [(request, opened) for request, opened in self._opening if not opened.done()]
        self._opening = []
        if not sending:
            return
        waiting = [(request.request_id, opened) for request, opened in sending]
        try:
            ref = self._actor.open_many(self.channel_id, [request for request, _ in sending])
        except Exception as exc:  # noqa: BLE001 - not sent (e.g. Ray refused the call): each caller sees why
            for _, opened in waiting:
                opened.set_exception(exc)
            return
        task = asyncio.get_running_loop().create_task(self._opened(ref, waiting))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _opened(self, ref: Any, waiting: list[tuple[str, asyncio.Future[Any]]]) -> None:
        try:
            results = await ref
        except BaseException as exc:  # the call failed (the replica died): every request did
            for _, opened in waiting:
                if not opened.done():
                    opened.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        cancelled = []
        for (request_id, opened), result in zip(waiting, results, strict=True):
            if opened.done():  # its caller was cancelled meanwhile: cancel it now that it is open
                if not isinstance(result, BaseException):
                    cancelled.append(request_id)
                continue
            if isinstance(result, BaseException):
                opened.set_exception(result)
            else:
                opened.set_result(result)
        # Sent only now: Ray does not order calls to an async actor, so a cancel sent while the
        # open was on its way could run first, find nothing, and leave the request running.
        if cancelled and self.error is None:
            outside_request(self._actor.cancel, self.channel_id, cancelled)

    async def request(
        self, request: OpenRequest, token_ids: list[int] | None = None, prefilled: Callable[[], None] | None = None
    ) -> AsyncIterator[Item]:
        """What the replica answers to ``request`` (an ``HttpHead``, then body bytes); the
        replica refuses it with ``ReplicaBusy`` if ``request.limit`` requests are open there.
        ``request.request_id`` is set here (unique on this channel). ``token_ids`` (with
        ``request.want_token_ids``) is extended with the ids the replica reports, and outlives
        the request (a stream that moves resumes after them). ``prefilled`` is told if the
        replica says the prompt is computed before any output (kv_events: an answer not streamed)."""
        if self.error is not None:
            raise self.error
        if self._retired:
            raise ConnectionError("the channel was retired: its replica left the routing table")
        self._start_reader()
        request_id = request.request_id = uuid.uuid4().hex
        inbox = self._inboxes[request_id] = _Inbox(token_ids, prefilled)
        try:
            opened = self._open(request)
            try:
                self._note_load(await opened)
            except BaseException:
                # Refused or failed: nothing runs. Cancelled while waiting: _send_opens does not
                # send it, or _opened cancels it once open (a cancel sent now could overtake the
                # open) -- unless it was open already: then the finally cancels it.
                if not (opened.done() and not opened.cancelled() and opened.exception() is None):
                    inbox.end()
                raise
            async for item in inbox:
                yield item
        finally:
            del self._inboxes[request_id]
            if not inbox.ended and self.error is None:  # the consumer left early: abort it
                outside_request(self._actor.cancel, self.channel_id, [request_id])
            if self._retired and not self._inboxes:
                self.close()

    def retire(self) -> None:
        """Take no new requests, and close once the open ones end: a replica that left the
        routing table (draining in a rolling update) still finishes what it holds."""
        self._retired = True
        if not self._inboxes:
            self.close()

    @property
    def retired_and_closed(self) -> bool:
        return self._retired and not self._inboxes and (self._reader is None or self._reader.done())

    def close(self) -> list[asyncio.Task[None]]:
        """Stop reading and renewing; the tasks, to await on the way out."""
        tasks = [t for t in (self._reader, self._renewer) if t is not None]
        for task in tasks:
            task.cancel()
        return tasks
