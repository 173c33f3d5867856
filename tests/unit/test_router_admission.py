"""Router admission without Ray, through ``Router.stream``: queueing, rejecting, and waiting
for a replica. The replica is a fake of its actor's channel methods over the real
``ChannelHub``, holding its one slot (``max_concurrent: 1``) until its gate opens."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.errors import CapacityExhausted, DeploymentNotFound, NoReadyReplica
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.wire import HttpHead, HttpRequest, RequestKind, RoutingFacts

from .fakes import JSON, FakeReplica, GatedReplica, answer, request, route, text_of


def router(mode: str = "queue", replicas=(), **kw) -> Router:
    table = RoutingTable(1, {"d": DeploymentRoute("d", 1, mode, tuple(route(r) for r in replicas))})

    async def source(version):
        return table if version != table.version else None

    return Router(source, **kw)


async def text(r: Router) -> str:
    return await text_of(r, "d")


async def occupy(replica: GatedReplica, r: Router) -> asyncio.Task[str]:
    """A request that holds the replica's only slot until ``replica.gate`` opens."""
    task = asyncio.create_task(text(r))
    while replica.hub.open_requests == 0:
        await asyncio.sleep(0.01)
    return task


def test_queue_waits_past_the_replica_wait_until_a_slot_frees():
    async def main():
        replica = GatedReplica("r0")
        r = router("queue", (replica,), wait_for_replica_s=0.1)
        first = await occupy(replica, r)
        second = asyncio.create_task(text(r))
        await asyncio.sleep(0.5)
        assert not second.done()  # still queued, well past wait_for_replica_s
        assert replica.calls == 1  # and not sent: the router knows the replica is full
        replica.gate.set()
        return await asyncio.wait_for(asyncio.gather(first, second), 5)

    assert asyncio.run(main()) == ["from r0", "from r0"]


def test_queue_timeout_and_reject_raise_capacity_exhausted():
    async def main(mode, **kw):
        replica = GatedReplica("r0")
        r = router(mode, (replica,), **kw)
        first = await occupy(replica, r)
        try:
            await text(r)
        finally:
            replica.gate.set()
            await first

    with pytest.raises(CapacityExhausted):
        asyncio.run(main("queue", queue_timeout_s=0.2))
    with pytest.raises(CapacityExhausted, match="at capacity"):
        asyncio.run(main("reject"))


def test_no_ready_replica_after_the_bounded_wait_and_unknown_names():
    with pytest.raises(NoReadyReplica, match="waited"):
        asyncio.run(text(router(replicas=(), wait_for_replica_s=0.3)))

    async def unknown():
        r = router(replicas=(GatedReplica("r0"),))
        return await text_of(r, "other")

    with pytest.raises(DeploymentNotFound, match="deployments: d"):
        asyncio.run(unknown())


class TokenizesAtOnce(GatedReplica):
    """Holds generation requests until its gate opens; answers tokenizing at once, as vLLM's
    serving layer does (no engine step)."""

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        if request.path in NO_ENGINE_STEP:
            put(HttpHead(200, JSON))
            put(b"tokenized")
        else:
            await self._answer(put)


STORED = "/v1/responses/resp_d.r0.0123/cancel"  # a stored response's cancel (as its retrieve)
NO_ENGINE_STEP = ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/chat/completions/render", STORED)


@pytest.mark.parametrize("path", NO_ENGINE_STEP)
@pytest.mark.parametrize("mode", ["queue", "reject"])
def test_tokenizing_is_not_held_to_max_concurrent(mode, path):
    """At capacity, a request that runs no engine step (tokenizing, rendering, a stored
    response's retrieve or cancel) is answered at once (it waited for a generation to end, or got
    429), while a generation request still queues or is refused."""

    async def main():
        replica = TokenizesAtOnce("r0")
        r = router(mode, (replica,), queue_timeout_s=0.2)
        first = await occupy(replica, r)
        data = {"model": "d", "prompt": "hi"}
        facts = (RoutingFacts("d", RequestKind.STORED, response_id="resp_d.r0.0123") if path == STORED
                 else RoutingFacts.of(path, data))
        try:
            _, body = await asyncio.wait_for(answer(r.stream(facts, HttpRequest("POST", path, JSON, b"{}"))), 5)
            with pytest.raises(CapacityExhausted):
                await text(r)
        finally:
            replica.gate.set()
            await first
        return body

    assert asyncio.run(main()) == b"tokenized"


class HoldsTokenizing(FakeReplica):
    """Answers generation at once; holds tokenizing until ``gate`` opens (a slow tokenizer)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate, self.tokenizing = asyncio.Event(), 0

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        if request.path == "/tokenize":
            self.tokenizing += 1
            await self.gate.wait()
        await self._answer(put)


@pytest.mark.parametrize("routers", ["one router", "two routers"])
def test_tokenizing_does_not_count_toward_the_limit_of_generation(routers):
    """With ``max_concurrent: 1``, a /tokenize still open leaves the slot to a chat request:
    the router does not count it, nor does the replica (a second router, another ingress, knows
    only what the replica counts). Before, the chat request got 429 (``reject``)."""

    async def main():
        replica = HoldsTokenizing("r0")
        r = router("reject", (replica,))
        other = r if routers == "one router" else router("reject", (replica,))
        facts = RoutingFacts.of("/tokenize", {"model": "d", "prompt": "hi"})
        tokenizing = asyncio.create_task(answer(r.stream(facts, HttpRequest("POST", "/tokenize", JSON, b"{}"))))
        while not replica.tokenizing:
            await asyncio.sleep(0.01)
        try:
            assert replica.hub.open_requests == 0  # what the replica's batches and answers say
            return await asyncio.wait_for(text(other), 5)
        finally:
            replica.gate.set()
            await tokenizing

    assert asyncio.run(main()) == "from r0"


class QueueFull(FakeReplica):
    """vLLM's own admission (``max_num_queued_reqs``) refuses its first ``refusals`` requests with a
    503, which vLLM sends so that "load balancers retry the request on a different instance"."""

    refusals = 1

    async def _answer(self, put):
        if self.calls <= self.refusals:
            put(HttpHead(503, JSON))
            put(b'{"error":{"message":"The engine is currently busy and cannot accept new requests.","code":503}}')
        else:
            await super()._answer(put)


def test_a_replica_whose_engine_queue_is_full_is_routed_around_like_one_at_its_limit():
    """The 503 went to the client as the answer, whatever room the deployment's replicas had."""
    async def main():
        full = QueueFull("r0")
        r = router("queue", (full,))
        return await text(r), full.calls

    assert asyncio.run(main()) == ("from r0", 2)  # counted full, then routed again once it said otherwise


def test_a_request_the_engine_refuses_every_time_gets_its_503_after_the_tries():
    """More choices than vLLM's queue holds: it refuses them on every replica, every time. The
    request was routed again for good, reported as demand all the while (scaling up replicas that
    refused it too); it now gets vLLM's 503 after MAX_ATTEMPTS tries, as before the retry."""
    from atomr_infer.routing.router import MAX_ATTEMPTS

    async def main():
        full = QueueFull("r0")
        full.refusals = 1_000
        r = router("queue", (full,))
        head, body = await asyncio.wait_for(answer(r.stream(*request())), 10)
        return head.status, body, full.calls

    status, body, calls = asyncio.run(main())
    assert status == 503 and b"currently busy" in body and calls == MAX_ATTEMPTS
