"""Router admission without Ray: queueing, rejecting, and waiting for a replica."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.errors import CapacityExhausted, DeploymentNotFound, NoReadyReplica
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable

R0 = ReplicaRoute("r0", "atomr:d:r0", actor=None)


def table(mode: str = "queue", replicas=(R0,)) -> RoutingTable:
    return RoutingTable(1, {"d": DeploymentRoute("d", 1, mode, tuple(replicas))})


def router(t: RoutingTable, **kw) -> Router:
    async def source(version):
        return t if version != t.version else None

    return Router(source, **kw)


def test_queue_waits_past_the_replica_wait_until_a_slot_frees():
    async def main():
        r = router(table(), wait_for_replica_s=0.1)
        r._in_flight["atomr:d:r0"] = 1  # the only slot is taken
        task = asyncio.create_task(r._route("d"))
        await asyncio.sleep(0.5)
        assert not task.done()  # still queued, well past wait_for_replica_s
        r._in_flight["atomr:d:r0"] = 0
        r._released.set()
        _, route = await asyncio.wait_for(task, 2)
        return route

    assert asyncio.run(main()) is R0


def test_queue_timeout_and_reject_raise_capacity_exhausted():
    async def main(mode, **kw):
        r = router(table(mode), **kw)
        r._in_flight["atomr:d:r0"] = 1
        await r._route("d")

    with pytest.raises(CapacityExhausted):
        asyncio.run(main("queue", queue_timeout_s=0.2))
    with pytest.raises(CapacityExhausted, match="at capacity"):
        asyncio.run(main("reject"))


def test_no_ready_replica_after_the_bounded_wait_and_unknown_names():
    with pytest.raises(NoReadyReplica, match="waited"):
        asyncio.run(router(table(replicas=()), wait_for_replica_s=0.3)._route("d"))
    with pytest.raises(DeploymentNotFound, match="deployments: d"):
        asyncio.run(router(table())._route("other"))
