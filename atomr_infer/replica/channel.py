"""The replica's end of the data path: one channel per router, one Ray object per batch.

A router (the ingress's, a ``Client``'s) opens requests on a replica with ``open_many`` and reads
everything those requests produce from one long-lived streaming call, ``channel``. Each object
on that stream is a ``Batch``: the replica's load (and the prefill its requests wait for, as
their routers estimated it, and which of this router's the engine prefilled before any output:
kv_events), and for every request of that router with
news, the items it produced since the last batch (an ``HttpHead`` and body bytes, merged:
merging.py), the token ids it generated if its router asked, and whether it ended, with its
error (the types are wire.py's). So the Ray cost per engine step is one object per
(router, replica) pair, not one per running request: measured with scripts/bench_dataplane.py,
see docs/performance.md.

No timer: a batch leaves as soon as the channel's task runs after something was put, so the
first token of a request is not held back; whatever the requests put meanwhile (the rest of
that engine step) rides along. Each request runs in a task of its own (``start``) that puts
its items straight into the next batch; cancelling it (the router's ``cancel``, or the channel
going away) ends the request, which aborts it in the engine within one step.

A router that dies says nothing, and Ray does not stop a streaming call whose caller is gone
(measured: a killed router's 1,500-token request ran to its end). So a channel is a lease: the
router renews it every ``KEEPALIVE_S`` (and with every call), and a channel not heard from for
``LEASE_S`` is closed by the replica's watchdog, which cancels its requests (wire.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from atomr_infer.errors import AtomrError, EngineError, ReplicaBusy
from atomr_infer.merging import join_bytes, put_merged
from atomr_infer.wire import LEASE_S, Batch, HttpHead, HttpRequest, OpenRequest, as_vllm_reads

Put = Callable[[HttpHead | bytes], None]
Tokens = Callable[[list[int]], None]
# serve(request, put, token sink, token ids to resume after, told once its prompt is computed):
# runs one request, putting its items; returns at the response's end.
Serve = Callable[[HttpRequest, Put, "Tokens | None", "list[int] | None", "Callable[[], None] | None"], Awaitable[None]]
# How long a channel id whose stream ended is remembered (a late call of its router comes
# within a lease or so; its router never uses the id again).
ENDED_KEEP_S = 4 * LEASE_S


def _streams_in_background(http: HttpRequest) -> bool:
    """A Responses request with ``background`` and ``stream``: vLLM runs it as a background task
    and, while the request is open, streams that task's events: one place, not two."""
    if not http.path.startswith("/v1/responses") or b"background" not in http.body:
        return False
    try:
        data = json.loads(http.body)
    except ValueError:
        return False
    return isinstance(data, dict) and as_vllm_reads(data.get("background")) and as_vllm_reads(data.get("stream"))


def _portable(exc: BaseException) -> BaseException:
    """An error the router can unpickle and act on: atomr's own as is, anything else as EngineError."""
    return exc if isinstance(exc, AtomrError) else EngineError(f"{type(exc).__name__}: {exc}")


class Channel:
    def __init__(self, load: Callable[[], int], prefill: Callable[[], int] = lambda: 0) -> None:
        self._load, self._prefill = load, prefill
        self._batch = Batch(0)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._uncounted: set[str] = set()  # of those, the ones that run no engine step (tokenizing)
        self._in_background: set[str] = set()  # of those, background streams (_streams_in_background)
        self._waiting: dict[str, int] = {}  # request id -> its prefill blocks, until its first output or prefilled()
        self.waiting_prefill = 0  # their sum
        self._ready = asyncio.Event()
        self._closed = False
        self._engine_failed: str | None = None
        self.heard_at = time.monotonic()  # the router's last call: open, cancel, keepalive

    def close(self, engine_failed: str | None = None) -> None:
        """End the stream (its finally cancels the requests) and take nothing more; with
        ``engine_failed``, its last batch says so (what its requests had put is dropped)."""
        self._closed = True
        self._engine_failed = engine_failed
        self.cancel(list(self._tasks))
        self._ready.set()

    @property
    def open_requests(self) -> int:
        """Its requests that run engine steps: tokenizing is neither held to nor counted in a limit."""
        return len(self._tasks) - len(self._uncounted)

    @property
    def background_streams(self) -> int:
        return len(self._in_background)

    def start(self, request: OpenRequest, serve: Serve) -> None:
        """Run one request: ``serve`` puts its items and returns at its end (or raises)."""
        if self._closed:  # its router's stream ended: nobody would read it (the router fails it)
            return
        task = asyncio.get_running_loop().create_task(self._pump(request, serve))
        self._tasks[request.request_id] = task
        if not request.runs_engine:
            self._uncounted.add(request.request_id)
        elif _streams_in_background(request.http):
            self._in_background.add(request.request_id)
        # _pump's finally forgets it before the batch that ends it; a task cancelled before its
        # first step never runs that finally: forget it here too (twice is harmless).
        task.add_done_callback(lambda _task, request_id=request.request_id: self._forget(request_id))
        if request.prefill_blocks:
            self._waiting[request.request_id] = request.prefill_blocks
            self.waiting_prefill += request.prefill_blocks

    def _prefilled(self, request_id: str) -> None:
        self.waiting_prefill -= self._waiting.pop(request_id, 0)

    def _forget(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        self._uncounted.discard(request_id)
        self._in_background.discard(request_id)
        self._prefilled(request_id)

    async def _pump(self, request: OpenRequest, serve: Serve) -> None:
        request_id = request.request_id

        def put(item: HttpHead | bytes) -> None:
            if request_id not in self._tasks:  # not after a cancel: nobody reads it
                return
            if self._waiting and not isinstance(item, HttpHead):  # its first output: prefilled
                self._prefilled(request_id)
            # What the router has not been sent yet is merged: fewer, larger items per message.
            put_merged(self._batch.items.setdefault(request_id, []), item, join_bytes)  # type: ignore[arg-type]
            self._ready.set()

        def tokens(ids: list[int]) -> None:
            if request_id in self._tasks:
                self._batch.token_ids.setdefault(request_id, []).extend(ids)

        def prefilled() -> None:  # before any output (an answer not streamed): tell its router
            if request_id in self._waiting:
                self._prefilled(request_id)
                self._batch.prefilled.append(request_id)
                self._ready.set()

        error: BaseException | None = None
        try:
            sink = tokens if request.want_token_ids else None
            await serve(request.http, put, sink, request.resume, prefilled if request.prefill_blocks else None)
        except asyncio.CancelledError:
            return  # the router cancelled it: nobody reads its end
        except Exception as exc:  # noqa: BLE001 - every failure goes to the router
            error = _portable(exc)
        finally:
            self._forget(request_id)
        self._batch.ended[request_id] = error
        self._ready.set()

    def cancel(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

    async def batches(self) -> AsyncIterator[Batch]:
        """The channel's messages, until the router goes away (then its requests are cancelled)."""
        try:
            while not self._closed:  # (closed before its stream began: the id of one that ended)
                if not self._batch:
                    self._ready.clear()
                    await self._ready.wait()
                    # One turn of the event loop: the other requests the same engine step woke
                    # put their output too, and leave in this batch (no timer: nothing waits).
                    await asyncio.sleep(0)
                if self._closed:
                    break
                batch, self._batch = self._batch, Batch(0)
                batch.load, batch.prefill = self._load(), self._prefill()
                yield batch
            if self._engine_failed is not None:  # however the close found the loop: its router hears why
                yield Batch(self._load(), engine_failed=self._engine_failed)
        finally:
            self.cancel(list(self._tasks))


class ChannelHub:
    """The channels of one replica, by id (one per router that sends to it)."""

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}
        # Channels whose stream ended or expired, by when: a late call of a slow router (an open,
        # a keepalive) must not create them again, unread (their router sees its stream end).
        self._ended: dict[str, float] = {}

    @property
    def open_requests(self) -> int:
        return sum(c.open_requests for c in self._channels.values())

    def in_flight(self, background: int) -> int:
        """The requests open here that run engine steps and the ``background`` responses
        generating (answered ``queued``, their requests ended), a background stream once."""
        return self.open_requests + max(0, background - sum(c.background_streams for c in self._channels.values()))

    @property
    def waiting_prefill(self) -> int:
        """Blocks of prefill its requests with no output yet wait for (kv_events)."""
        return sum(c.waiting_prefill for c in self._channels.values())

    def get(self, channel_id: str) -> Channel:
        """The channel ``channel_id``, created by whichever of ``open_many``, ``channel`` and
        ``keepalive`` comes first; the router was just heard from."""
        channel = self._channels.get(channel_id)
        if channel is None and channel_id in self._ended:
            channel = Channel(lambda: 0)
            channel.close()
            return channel
        if channel is None:
            channel = self._channels[channel_id] = Channel(lambda: self.open_requests, lambda: self.waiting_prefill)
        channel.heard_at = time.monotonic()
        return channel

    def open(self, channel: Channel, request: OpenRequest, serve: Serve, limit: int, replica: str,
             background: int = 0) -> int:
        """Start ``request`` on ``channel`` unless ``limit`` requests that run engine steps are
        open here, over every channel, counting the ``background`` responses (``in_flight``)
        (``ReplicaBusy``; tokenizing is not held to it); the requests open here now."""
        if request.runs_engine and self.in_flight(background) >= limit:
            raise ReplicaBusy(replica, limit)
        channel.start(request, serve)
        return self.open_requests

    def close_all(self, engine_failed: str) -> None:
        """Close every channel because the engine failed (or wedged): their routers move or
        re-run what they can on another replica, instead of ending it with this engine's error."""
        now = time.monotonic()
        for channel_id, channel in self._channels.items():
            channel.close(engine_failed)
            self._ended[channel_id] = now
        self._channels.clear()

    def expire(self, lease_s: float = LEASE_S) -> list[str]:
        """Close the channels whose router has not been heard from for ``lease_s``; their ids."""
        now = time.monotonic()
        gone = [cid for cid, c in self._channels.items() if now - c.heard_at > lease_s]
        for channel_id in gone:
            self._channels.pop(channel_id).close()
            self._ended[channel_id] = now
        self._ended = {cid: at for cid, at in self._ended.items() if now - at < ENDED_KEEP_S}
        return gone

    async def stream(self, channel_id: str) -> AsyncIterator[Batch]:
        channel = self.get(channel_id)
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]
            self._ended[channel_id] = time.monotonic()

    def cancel(self, channel_id: str, request_ids: list[str]) -> None:
        channel = self._channels.get(channel_id)
        if channel is not None:
            channel.heard_at = time.monotonic()
            channel.cancel(request_ids)
