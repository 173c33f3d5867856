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
