"""What a router reports to the manager as demand (routing/demand.py), through ``Router.stream``
with fake replicas, and what the autoscaler makes of it."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.control.autoscale import Autoscaler
from atomr_infer.errors import CapacityExhausted, NoReadyReplica
from atomr_infer.routing.demand import REFUSED_COUNTS_S, Demand
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.spec import Autoscaling

from .fakes import FakeReplica, GatedReplica, answer, request, route
from .test_router_admission import occupy, router, text


def test_requests_refused_at_capacity_are_reported_as_demand_and_scale_the_deployment_up() -> None:
    """on_capacity_exhausted: reject with every replica full: the refused requests were never
    reported, so the load never passed replicas x max_concurrent; with target_ongoing_requests at
    max_concurrent the autoscaler never scaled up while it answered 429."""
    reports: list[tuple[str, int]] = []

    async def main():
        replica = GatedReplica("r0")
        r = router("reject", (replica,), demand=lambda router_id, name, n: reports.append((name, n)))
        held = await occupy(replica, r)  # max_concurrent 1: full
        for _ in range(3):
            with pytest.raises(CapacityExhausted):
                await text(r)
            await asyncio.sleep(0.3)
        replica.gate.set()
        await held

    asyncio.run(main())
    assert reports[0] == ("d", 1) and len(reports) == 2 and reports[-1][1] >= 2, reports  # each counts a while
    cfg = Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=1, upscale_delay_s=0)
    scaler = Autoscaler(1)
    scaler.report_waiting("router", reports[-1][1], now=0.0)
    decision = scaler.decide(cfg, in_flight=1, now=0.0, cap=lambda n: (n, None))
    assert decision is not None and decision.to_replicas == 1 + reports[-1][1]


def test_a_refused_request_counts_for_a_short_while_only() -> None:
    reports: list[int] = []
    demand = Demand("router", lambda router_id, name, n: reports.append(n))
    demand.refused("d", now=10.0)
    demand.refused("d", now=10.2)  # within DEMAND_EVERY_S of the last report: not sent
    assert reports == [1] and demand.count("d", now=10.4) == 2
    assert demand.count("d", now=10.0 + REFUSED_COUNTS_S) == 1 and demand.count("d", now=11.3) == 0


def test_once_its_requests_stop_waiting_a_router_reports_that_none_wait() -> None:
    """The last report said 3 waiting; routed, the same 3 were in flight on the replica while the
    manager still counted that report (for 2 s): twice the load."""
    reports: list[tuple[str, int]] = []
    tables = {"now": RoutingTable(1, {"d": DeploymentRoute("d", 64, "queue", (), cold_start_timeout_s=300.0)})}

    async def source(version):
        return tables["now"] if version != tables["now"].version else None

    async def main():
        r = Router(source, refresh_s=0.0, demand=lambda router_id, name, n: reports.append((name, n)))
        waiting = [asyncio.create_task(answer(r.stream(*request()))) for _ in range(3)]
        await asyncio.sleep(0.6)  # they wait for a cold start, reported every 0.5 s
        tables["now"] = RoutingTable(2, {"d": DeploymentRoute("d", 64, "queue", (route(FakeReplica("r0")),))})
        await asyncio.wait_for(asyncio.gather(*waiting), 5)

    asyncio.run(main())
    assert ("d", 3) in reports and reports[-1] == ("d", 0), reports
    assert reports.count(("d", 0)) == 1  # once: the first of them routed sent nothing


def test_a_burst_refused_within_one_period_reaches_the_manager_whole() -> None:
    """50 requests refused within 0.25 s: the first was reported, the other 49 held back by the
    report's period and never sent (nothing else reports for requests that do not wait)."""
    reports: list[int] = []

    async def main():
        demand = Demand("router", lambda router_id, name, n: reports.append(n))
        loop = asyncio.get_running_loop()
        for _ in range(50):
            demand.refused("d", loop.time())
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.6)

    asyncio.run(main())
    assert reports[0] == 1 and reports[-1] == 50, reports


def test_a_caller_the_api_did_not_authenticate_starts_no_replica_of_a_deployment_at_zero() -> None:
    """/tokenize is open where the API has keys: a caller with no key, waiting on a deployment
    scaled to zero, was reported as demand, and the manager started a GPU replica for it. It now
    gets 503 at once and starts nothing; a caller the API authenticated still wakes it."""
    reports: list[tuple[str, int]] = []
    table = RoutingTable(1, {"d": DeploymentRoute("d", 64, "queue", (), cold_start_timeout_s=300.0)})

    async def source(version):
        return table if version != table.version else None

    async def main():
        r = Router(source, refresh_s=0.0, demand=lambda router_id, name, n: reports.append((name, n)))
        facts, http = request()
        facts.wakes = False
        with pytest.raises(NoReadyReplica):
            await asyncio.wait_for(answer(r.stream(facts, http)), 2)
        assert reports == []
        waking = asyncio.create_task(answer(r.stream(*request())))
        await asyncio.sleep(0.1)
        waking.cancel()

    asyncio.run(main())
    assert reports[0] == ("d", 1)  # (then 0, once it was cancelled)
