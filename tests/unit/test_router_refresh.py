"""One routing-table fetch at a time, and a Client that reads a finished stream to its end
(no Ray: the replica is a fake of its channel methods over the real ``ChannelHub``)."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.client import Client
from atomr_infer.replica.openai_app import HttpHead
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable

from .fakes import FakeReplica, _Remote, route


class SlowSource:
    """A manager whose routing table takes ``delay_s`` to come, counting the calls."""

    def __init__(self, replica: FakeReplica | None = None, delay_s: float = 0.05, fail: bool = False) -> None:
        self.calls, self.delay_s, self.fail = 0, delay_s, fail
        replicas = () if replica is None else (route(replica),)
        self.table = RoutingTable(1, {"d": DeploymentRoute("d", 4096, "queue", replicas)})

    async def __call__(self, version: int) -> RoutingTable | None:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("the manager is down")
        return self.table if version != self.table.version else None


def test_requests_arriving_together_share_one_fetch_of_each_kind():
    source = SlowSource()

    async def main():
        router = Router(source, refresh_s=60.0)
        tables = await asyncio.gather(*(router.refresh() for _ in range(100)))
        assert source.calls == 1 and {t.version for t in tables} == {1}
        forced = await asyncio.gather(*(router.refresh(force=True) for _ in range(100)))
        assert source.calls == 2 and {t.version for t in forced} == {1}
        await router.refresh()  # fresh: no call at all
        assert source.calls == 2

    asyncio.run(main())


def test_with_nothing_cached_a_failed_fetch_fails_every_waiter():
    source = SlowSource(fail=True)

    async def main():
        router = Router(source)
        return await asyncio.gather(*(router.refresh() for _ in range(5)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ConnectionError) for r in results)


def test_a_cancelled_fetch_leaves_the_others_to_fetch_again():
    source = SlowSource()

    async def main():
        router = Router(source)
        first = asyncio.ensure_future(router.refresh())
        await asyncio.sleep(0.01)  # the fetch has started
        waiter = asyncio.ensure_future(router.refresh())
        await asyncio.sleep(0)
        first.cancel()
        table = await waiter
        assert table.version == 1 and source.calls == 2
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())


class SseReplica(FakeReplica):
    """Answers an ``http`` request as vLLM streams one: a head, an event, ``[DONE]``; the end of
    the request comes a moment later, in a batch of its own."""

    async def _answer(self, put):
        put(HttpHead(200, (("content-type", "text/event-stream"),)))
        put(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        put(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05)

    async def _cancel(self, channel_id, request_ids):
        self.cancelled += len(request_ids)
        await super()._cancel(channel_id, request_ids)


class FakeManager:
    def __init__(self, source: SlowSource) -> None:
        self.routing_table = _Remote(source)
        self.report_demand = _Remote(self._demand)

    async def _demand(self, *args):
        return None


def test_a_client_stream_read_to_done_cancels_nothing_on_the_replica():
    replica = SseReplica("r0")
    replica.cancelled = 0
    client = Client(manager=FakeManager(SlowSource(replica, delay_s=0.0)))

    async def one():
        return [e async for e in client.astream_chat_events("d", [{"role": "user", "content": "x"}])]

    async def main():
        return await asyncio.gather(*(one() for _ in range(20)))

    streams = asyncio.run(main())
    assert all(s == [{"choices": [{"delta": {"content": "hi"}}]}] for s in streams)
    assert replica.cancelled == 0


def test_a_client_that_leaves_mid_stream_still_cancels_its_request():
    replica = SseReplica("r0")
    replica.cancelled = 0
    client = Client(manager=FakeManager(SlowSource(replica, delay_s=0.0)))

    async def main():
        async for _ in client.astream_chat_events("d", [{"role": "user", "content": "x"}]):
            break  # leaves after the first event: the request has not ended
        await asyncio.sleep(0.01)  # the cancel call runs

    asyncio.run(main())
    assert replica.cancelled == 1
