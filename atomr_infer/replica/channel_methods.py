"""The replica's methods that routers call (replica/channel.py holds the channels themselves).

A mixin of ``VllmReplica`` (replica/actor.py), kept apart because it is the replica's network
face: opening requests (every request a router opened in one turn of its event loop, in one
call), the channel stream, cancel and keepalive. What it uses of the replica is
declared below.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from atomr_infer.errors import AtomrError, ReplicaBusy
from atomr_infer.replica.channel import Batch, ChannelHub
from atomr_infer.replica.openai_app import HttpRequest, OpenAIApp
from atomr_infer.spec import Deployment


class ChannelMethods:
    _channels: ChannelHub
    _deployment: Deployment
    _admit: Callable[[], None]  # raises unless the replica takes new requests
    _wait_ready: Callable[[float | None], Awaitable[None]]
    _openai_app: Callable[[], Awaitable[OpenAIApp]]
    generate: Callable[[Any], AsyncIterator[Any]]

    async def open_many(self, channel_id: str, requests: list[tuple[str, str, Any, int | None]]) -> list[Any]:
        """Admit each ``(request_id, method, request, limit)`` and run it into the caller's channel
        (``generate`` or ``http``), in order, in one call: a router sends every request it opened
        here in one turn of its event loop together (a Ray call costs ~0.6 ms of CPU in a burst;
        a thousand requests at once cost seconds). Returns, per request, the requests now open
        here, or the error that refused it: ``ReplicaBusy`` at ``limit`` (the routing table's
        ``serving.max_concurrent``, which changes in place; else this replica's spec), counted
        over every router; ``ReplicaUnavailable`` when draining or stopped."""
        results: list[Any] = []
        for request_id, method, request, limit in requests:
            try:
                results.append(self._open(channel_id, request_id, method, request, limit))
            except AtomrError as exc:
                results.append(exc)
        return results

    def _open(self, channel_id: str, request_id: str, method: str, request: Any, limit: int | None) -> int:
        self._admit()
        limit = limit or self._deployment.serving.max_concurrent
        if self._channels.open_requests >= limit:
            raise ReplicaBusy(repr(self), limit)
        serve = self._serve_http if method == "http" else self._serve_generate
        self._channels.get(channel_id).start(request_id, lambda put: serve(request, put))
        return self._channels.open_requests

    async def _serve_http(self, request: HttpRequest, put: Callable[[Any], None]) -> None:
        await self._wait_ready(None)
        self._admit()
        app = await self._openai_app()
        await app.run(request, put)

    async def _serve_generate(self, request: Any, put: Callable[[Any], None]) -> None:
        async for chunk in self.generate(request):
            put(chunk)

    async def channel(self, channel_id: str) -> AsyncIterator[Batch]:
        """The output of every request opened on ``channel_id``, in batches. Call as a Ray
        streaming generator, once per router; closing it cancels that router's requests."""
        async for batch in self._channels.stream(channel_id):
            yield batch

    async def cancel(self, channel_id: str, request_ids: list[str]) -> None:
        """The router's consumers left: abort these requests."""
        self._channels.cancel(channel_id, request_ids)

    async def keepalive(self, channel_id: str) -> None:
        """The router of ``channel_id`` is alive (replica/channel.py: a channel is a lease)."""
        self._channels.get(channel_id)
