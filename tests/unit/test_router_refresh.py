"""One routing-table fetch at a time: requests that arrive together share it (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable

from .fakes import FakeReplica, route


class SlowSource:
    """A manager whose routing table takes ``delay_s`` to come (or until ``gate`` is set, when
    there is one), counting the calls."""

    def __init__(self, replica: FakeReplica | None = None, delay_s: float = 0.05, fail: bool = False) -> None:
        self.calls, self.delay_s, self.fail = 0, delay_s, fail
        self.gate: asyncio.Event | None = None
        replicas = () if replica is None else (route(replica),)
        self.table = RoutingTable(1, {"d": DeploymentRoute("d", 4096, "queue", replicas)})

    async def __call__(self, version: int) -> RoutingTable | None:
        self.calls += 1
        await (self.gate.wait() if self.gate is not None else asyncio.sleep(self.delay_s))
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
        source.gate = asyncio.Event()  # every fetch waits for it: no timing involved
        router = Router(source)
        first = asyncio.ensure_future(router.refresh())
        while source.calls == 0:
            await asyncio.sleep(0)  # until the fetch has started
        waiter = asyncio.ensure_future(router.refresh())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        source.gate.set()
        table = await waiter
        assert table.version == 1 and source.calls == 2
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())


class SilentManager:
    """A manager whose long poll never answers: the cache keeps the tables the test gives it."""

    class routing_table:  # noqa: N801 - stands for an actor method (``.remote``)
        @staticmethod
        async def remote(version: int, timeout_s: float) -> None:
            await asyncio.Event().wait()


def test_the_ingress_copy_of_the_table_is_read_without_a_turn_of_the_event_loop():
    """The ingress's copy (kept current by long poll) is read at once: a refresh that is not
    forced neither starts a task nor waits, so it never suspends the request (each turn of a
    busy event loop cost TTFT), and a newer copy is taken as a fetched table is."""
    from atomr_infer.serve.table_cache import TableCache

    first = SlowSource(FakeReplica("r0")).table
    newer = RoutingTable(2, {"d": DeploymentRoute("d", 4096, "queue", (route(FakeReplica("r1")),))})

    async def main():
        cache = TableCache(lookup=SilentManager)
        router = Router(cache.get, refresh_s=0.0, fresh_source=cache.fetch, peek=cache.peek)
        try:
            with pytest.raises(LookupError):
                cache.peek(-1)  # nothing yet: the router waits for the first table instead
            cache._take(first)
            assert await router.refresh() is first
            router.exclude("atomr:d:r0", permanent=False)  # until a newer table
            results = []
            for table in (first, newer):  # unchanged, then changed by the long poll
                cache._take(table)
                step = router.refresh()
                with pytest.raises(StopIteration) as done:
                    step.send(None)  # ran to its end without suspending once
                results.append(done.value.value)
            assert results == [first, newer] and router.table is newer
            assert router._excluded == {}  # taken as a fetched table is: the exclusion is over
            assert router._background is None  # no task was started for it
        finally:
            cache.stop()

    asyncio.run(main())
