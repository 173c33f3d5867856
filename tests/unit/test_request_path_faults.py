"""A Client whose manager hangs, the ingress's manager lookup, a channel the replica expired, and
a router closed under its requests (fakes over the real Router, ChannelHub and TableCache)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from atomr_infer.errors import RouterClosed, RoutingError
from atomr_infer.replica.channel import ChannelHub
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.wire import HttpHead, HttpRequest, OpenRequest, RoutingFacts

from .fakes import JSON, FakeManager, FakeReplica, route


def test_a_client_whose_manager_never_answers_fails_in_bounded_time(monkeypatch):
    from atomr_infer.client import Client
    from atomr_infer.routing import manager_link

    monkeypatch.setattr(manager_link, "TABLE_FETCH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(manager_link, "RECOVERY_POLL_S", 0.0)

    async def main():
        client = Client(manager=FakeManager(lambda version: asyncio.Event().wait()), wait_for_replica_s=0.1)
        with pytest.raises(RoutingError, match="did not answer"):
            await asyncio.wait_for(client.astream_chat_events("d", []).__anext__(), 5)

    asyncio.run(main())


def test_the_manager_is_looked_up_off_the_event_loop():
    from atomr_infer.serve.table_cache import TableCache

    def slow_lookup():  # ray.get_actor with the GCS away: a blocking call
        time.sleep(0.5)
        return FakeManager(lambda version: asyncio.sleep(0, RoutingTable(1)))

    async def main():
        cache = TableCache(lookup=slow_lookup)
        longest, last = 0.0, time.monotonic()

        async def ticker():  # every other stream of the ingress
            nonlocal longest, last
            while True:
                await asyncio.sleep(0.01)
                longest, last = max(longest, time.monotonic() - last), time.monotonic()

        tick = asyncio.create_task(ticker())
        try:
            await asyncio.sleep(0.05)
            assert (await cache.fetch(-1)).version == 1
            await asyncio.sleep(0.05)
        finally:
            tick.cancel()
            cache.stop()
        return longest

    assert asyncio.run(main()) < 0.25


def test_a_channel_whose_stream_ended_is_not_created_again_by_a_late_call():
    # The lease ran out (the router was slow, not dead); an open it sent meanwhile arrives.
    async def main():
        hub, started = ChannelHub(), asyncio.Event()

        async def read():
            async for _ in hub.stream("c"):
                pass

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)
        hub.expire(0.0)

        async def serve(*args):
            started.set()
            await asyncio.Event().wait()

        hub.get("c").start(OpenRequest("x", HttpRequest("POST", "/v1/completions", JSON, b"{}")), serve)
        await reader
        for _ in range(5):
            await asyncio.sleep(0)
        return started.is_set(), hub.open_requests, list(hub._channels)

    assert asyncio.run(main()) == (False, 0, [])  # nothing runs unread, uncounted, uncancellable


def test_a_late_stream_call_for_a_channel_that_ended_ends_at_once():
    async def main():
        hub = ChannelHub()
        hub.get("c")
        hub.expire(0.0)  # its router was not heard from: gone before its stream call arrived

        async def read():
            return [batch async for batch in hub.stream("c")]

        return await asyncio.wait_for(read(), 2)  # its router's reader sees the end and moves on

    assert asyncio.run(main()) == []


class Streaming(FakeReplica):
    async def _answer(self, put):
        put(HttpHead(200, JSON))
        put(b"data: {}\n\n")
        await asyncio.Event().wait()


@pytest.mark.parametrize("stream", [False, True])
def test_closing_a_router_ends_its_requests_without_blaming_the_replica(stream):
    r0, r1 = Streaming("r0"), Streaming("r1")
    table = RoutingTable(1, {"d": DeploymentRoute("d", 10, "queue", (route(r0), route(r1)))})
    data = {"model": "d", "prompt": "hi", "stream": stream}
    facts = RoutingFacts.of("/v1/completions", data)
    request = HttpRequest("POST", "/v1/completions", JSON, json.dumps(data).encode())

    async def main():
        router = Router(lambda version: asyncio.sleep(0, table if version != 1 else None), refresh_s=3600)
        got = []

        async def consume():
            async for item in router.stream(facts, request):
                got.append(item)

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.01)
        await router.aclose()  # Client.aclose()
        with pytest.raises(RouterClosed):
            await asyncio.wait_for(task, 5)
        return router._excluded, dict(router.migrations), router._channels

    assert asyncio.run(main()) == ({}, {}, {})


def test_callers_that_time_out_share_one_manager_lookup():
    from atomr_infer.serve.table_cache import TableCache

    lookups = []

    def away():  # ray.get_actor with the GCS away
        lookups.append(1)
        time.sleep(0.5)
        raise ValueError("Failed to look up actor")

    async def main():
        cache = TableCache(lookup=away)

        async def probe():  # /health, /v1/models: bounded by MANAGER_CALL_TIMEOUT_S
            with pytest.raises(Exception):  # noqa: B017, PT011
                await asyncio.wait_for(cache.manager(), 0.05)
            cache.forget_manager()

        await asyncio.gather(*[probe() for _ in range(12)])
        await asyncio.sleep(0.6)

    asyncio.run(main())
    assert len(lookups) == 1  # not a thread each, filling the executor the router's tokenizing shares
