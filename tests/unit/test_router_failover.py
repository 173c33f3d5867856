"""Router failover without Ray: a replica seen dead or draining leaves the picks at once.

The replicas are fakes of the Ray actor handle's channel methods, over the replica's real
``ChannelHub``; the real path is covered by tests/integration/test_manager.py (a replica killed
under load).
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    RaySystemError,
    RayTaskError,
)

from atomr_infer.errors import EngineError, ReplicaUnavailable
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.serve.table_cache import TableCache

from .fakes import FakeManager, FakeReplica, GatedReplica, route
from .fakes import text_of as body_text


class Tables:
    """A manager that publishes ``tables`` in turn, one per ``publish()``."""

    def __init__(self, *replicas: FakeReplica) -> None:
        self.table = self._make(1, replicas)

    @staticmethod
    def _make(version: int, replicas) -> RoutingTable:
        return RoutingTable(version, {"d": DeploymentRoute("d", 64, "queue", tuple(route(r) for r in replicas))})

    def publish(self, *replicas: FakeReplica) -> None:
        self.table = self._make(self.table.version + 1, replicas)

    async def source(self, version: int) -> RoutingTable | None:
        return self.table if version != self.table.version else None


async def text_of(router: Router, deployment: str = "d") -> str:
    return await body_text(router, deployment)


# Its actor died, or Ray itself lost the call or its output (its node died; a batch lost with
# the node's object store): either way the request goes on on another replica.
@pytest.mark.parametrize("error", [
    ActorDiedError(), NodeDiedError("its node died"), ObjectLostError("ab" * 14, "owner", "call site"),
    RaySystemError("lost the call"),
])
def test_after_a_replica_dies_every_request_succeeds_and_it_is_not_picked_again(error):
    dead, alive = FakeReplica("r0", error), FakeReplica("r1")
    tables = Tables(dead, alive)  # the table still lists the dead replica

    async def main():
        router = Router(tables.source, refresh_s=0.0)
        return [await text_of(router) for _ in range(20)]

    assert asyncio.run(main()) == ["from r1"] * 20
    assert dead.calls <= 1  # tried at most once, then excluded (dead: for good; lost: until a newer table)


def test_draining_replica_is_left_and_the_request_retried():
    draining = FakeReplica("r0", RayTaskError("generate", "tb", ReplicaUnavailable("r0 is draining")))
    alive = FakeReplica("r1")
    tables = Tables(draining, alive)

    async def main():
        router = Router(tables.source, refresh_s=0.0)
        return [await text_of(router) for _ in range(10)]

    assert asyncio.run(main()) == ["from r1"] * 10
    assert draining.calls <= 1


def test_unreachable_replica_returns_with_a_newer_table_dead_one_does_not():
    flaky, dead, alive = FakeReplica("r0", ActorUnavailableError("net", None)), FakeReplica("r2"), FakeReplica("r1")
    tables = Tables(flaky, alive)

    async def main():
        router = Router(tables.source, refresh_s=0.0)
        # Power of two picks the flaky one first with probability 1/2 a request (5 requests left
        # it untried once in 32 runs); 40 make that 1 in 10^12.
        for _ in range(40):
            assert await text_of(router) == "from r1"
        assert flaky.calls == 1  # tried once, then left alone while it is unreachable
        flaky.error = None  # reachable again; the manager publishes a newer table
        dead.error = ActorDiedError()
        tables.publish(flaky, alive, dead)
        await router.refresh(force=True)
        seen = {await text_of(router) for _ in range(40)}
        assert seen == {"from r0", "from r1"}
        tables.publish(flaky, alive, dead)  # a newer table still listing the dead replica
        for _ in range(10):
            await text_of(router)
        return dead.calls

    assert asyncio.run(main()) == 1


def test_when_every_replica_is_gone_the_request_waits_for_a_replacement():
    dead, replacement = FakeReplica("r0", ActorDiedError()), FakeReplica("r2")
    tables = Tables(dead)

    async def main():
        router = Router(tables.source, refresh_s=0.0, wait_for_replica_s=10.0)
        task = asyncio.create_task(text_of(router))
        await asyncio.sleep(0.6)
        assert not task.done()  # waiting: its only replica is dead
        tables.publish(replacement)
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == "from r2"


def test_an_alias_routes_to_its_deployment():
    replica = FakeReplica("r0")
    table = RoutingTable(1, {"d": DeploymentRoute("d", 8, "queue", (route(replica),), aliases=("smol", "tiny"))})

    async def source(version):
        return table if version != table.version else None

    async def main():
        router = Router(source)
        return [await text_of_model(router, name) for name in ("d", "smol", "tiny")]

    assert asyncio.run(main()) == ["from r0"] * 3


async def text_of_model(router: Router, name: str) -> str:
    return await body_text(router, name)


def test_a_request_in_flight_on_a_replica_that_leaves_the_table_still_finishes():
    # A rolling update drops the old replica from the table while it drains its requests:
    # the router must keep reading that replica's channel until they end (it used to close
    # the channel at once, and the request waited forever).
    old, new = GatedReplica("r0"), FakeReplica("r1")
    tables = Tables(old)

    async def main():
        router = Router(tables.source, refresh_s=0.0)
        in_flight = asyncio.create_task(text_of(router))
        while old.hub.open_requests == 0:
            await asyncio.sleep(0.01)
        tables.publish(new)  # the old replica is draining: no longer listed
        assert await text_of(router) == "from r1"  # this refresh saw the new table
        old.gate.set()
        answer = await asyncio.wait_for(in_flight, 5)
        await router.aclose()
        return answer

    assert asyncio.run(main()) == "from r0"


def test_a_deployment_the_ingress_copy_lacks_yet_is_found_by_asking_the_manager():
    """The ingress's table is a copy kept by long poll: a deployment applied a moment ago may
    not be in it yet. The router then asks the manager itself (``fresh_source``), not 404."""
    table = Tables(FakeReplica("r0")).table

    async def source(since_version):
        return table if since_version != table.version else None

    manager = FakeManager(source, lag_long_polls=True)
    cache = TableCache(lookup=lambda: manager)
    cache._table = RoutingTable(table.version - 1, {})  # its copy from before the apply
    cache._loaded.set()

    async def main():
        router = Router(cache.get, refresh_s=0.0, fresh_source=cache.fetch)
        try:
            return [await text_of(router) for _ in range(3)]
        finally:
            cache.stop()

    assert asyncio.run(main()) == ["from r0"] * 3
    assert manager.asked == 1  # once: the copy has the new table from then on


def test_an_error_of_the_routers_own_side_fails_the_request_and_excludes_no_replica():
    from ray.exceptions import ObjectStoreFullError

    from atomr_infer.errors import EngineError

    failing, other = FakeReplica("r0", ObjectStoreFullError("the local object store is full")), FakeReplica("r1")
    tables = Tables(failing, other)

    async def main():
        router = Router(tables.source, refresh_s=0.0)
        with pytest.raises(EngineError, match="ObjectStoreFullError"):
            for _ in range(20):  # until it picks r0
                await text_of(router)
        return router._excluded

    assert asyncio.run(main()) == {}  # an exclusion would last until the table changes


class CrashingReplica(FakeReplica):
    """Its engine fails under the first request it serves: it closes its channels, saying so,
    and refuses later ones (unhealthy), as the replica does."""

    crashes = 0

    async def _open_many(self, channel_id, requests):
        if self.crashes:
            return [ReplicaUnavailable(f"{self.name} is unhealthy") for _ in requests]
        return await super()._open_many(channel_id, requests)

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.crashes += 1
        self.hub.close_all("RuntimeError: CUDA error: an illegal memory access was encountered")
        await asyncio.Event().wait()  # cancelled by the close


def test_a_request_whose_engine_failed_is_re_run_elsewhere_once_not_on_every_replica():
    """A replica whose engine fails closes its channels so that its requests go on elsewhere; a
    request that crashes every engine it meets (vLLM has had such bugs) took down up to four."""
    crashing = [CrashingReplica("c0"), CrashingReplica("c1"), CrashingReplica("c2")]

    async def main(*replicas):
        router = Router(Tables(*replicas).source, refresh_s=0.0)
        try:
            return await text_of(router)
        finally:
            await router.aclose()

    with pytest.raises(EngineError, match="the engines of two replicas failed under this request"):
        asyncio.run(main(*crashing))
    assert sum(r.crashes for r in crashing) == 2  # re-run once, then not on a third
    crashed, healthy = CrashingReplica("c3"), FakeReplica("r1")
    tables = Tables(crashed)

    async def moved():  # its engine fails, then a healthy replica joins: the request is re-run there
        router = Router(tables.source, refresh_s=0.0)
        task = asyncio.ensure_future(text_of(router))
        while not crashed.crashes:
            await asyncio.sleep(0.01)
        tables.publish(crashed, healthy)
        try:
            return await task
        finally:
            await router.aclose()

    assert asyncio.run(moved()) == "from r1" and crashed.crashes == 1


def test_a_channel_closed_for_a_failed_engine_says_so_whichever_turn_the_close_found_it_in():
    """Closed while its loop had just sent a batch (not waiting for the next), the channel ended
    without its last batch: the router saw a plain close, a death, and re-ran without bound."""
    from atomr_infer.replica.channel import Channel
    from atomr_infer.wire import Batch

    async def main():
        channel = Channel(lambda: 0)
        channel._batch = Batch(0, ended={"r": None})  # something to send at once
        batches = channel.batches()
        first = await anext(batches)
        channel.close("RuntimeError: boom")  # while the loop is past its wait
        return first, [b async for b in batches]

    first, rest = asyncio.run(main())
    assert first.ended == {"r": None} and [b.engine_failed for b in rest] == ["RuntimeError: boom"]
