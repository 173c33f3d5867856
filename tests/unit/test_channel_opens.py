"""A router opens the requests it sends a replica in one turn of its event loop with one
``open_many`` call (routing/channel.py), and each request still gets its own answer. The
replicas are fakes of the actor's channel methods over the real ``ChannelHub``; the real
replica's ``open_many`` runs in tests/integration/test_channels.py."""

from __future__ import annotations

import asyncio

from ray.exceptions import RayTaskError

from atomr_infer.errors import ReplicaBusy
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.wire import HttpHead

from .fakes import JSON, FakeReplica, answer, request, route, text_of


class Recording(FakeReplica):
    """Records the size of every ``open_many`` call; refuses the requests ``refuse`` picks."""

    def __init__(self, name: str, refuse=lambda n: False) -> None:
        super().__init__(name)
        self.batches: list[int] = []
        self._refuse, self._seen = refuse, 0

    async def _open_many(self, channel_id, requests):
        self.batches.append(len(requests))
        return await super()._open_many(channel_id, requests)

    async def _open(self, channel_id, opening):
        self._seen += 1
        if self._refuse(self._seen):
            self.calls += 1
            raise RayTaskError("open", "tb", ReplicaBusy(self.name, 1))
        return await super()._open(channel_id, opening)


def router(*replicas: FakeReplica, refresh_s: float = 0.0) -> Router:
    table = RoutingTable(1, {"d": DeploymentRoute("d", 1000, "queue", tuple(route(r) for r in replicas))})

    async def source(version):
        return table if version != table.version else None

    return Router(source, refresh_s=refresh_s)


async def text(r: Router) -> str:
    return await text_of(r, "d")


def test_requests_opened_together_go_in_one_call_and_each_gets_its_answer():
    replica = Recording("r0")

    async def main():
        # The routing table is fetched once, before the burst; not again (a refresh due would
        # let a request that comes late in a slow burst route alone).
        r = router(replica, refresh_s=3600)
        await text(r)
        return await asyncio.gather(*(text(r) for _ in range(40)))

    assert asyncio.run(main()) == ["from r0"] * 40
    assert replica.batches == [1, 40]


def test_a_request_refused_inside_a_batch_is_routed_again_alone():
    picky = Recording("r0", refuse=lambda n: n % 2 == 0)  # busy for every second request it sees
    other = Recording("r1")

    async def main():
        r = router(picky, other)
        await text(r)
        await text(r)
        return await asyncio.gather(*(text(r) for _ in range(30)))

    answers = asyncio.run(main())
    assert len(answers) == 30 and set(answers) <= {"from r0", "from r1"}
    assert max(picky.batches) > 1  # several requests in one call, some of them refused
    assert picky._seen // 2 >= 1  # some were refused, and every one of them was answered elsewhere


def test_a_replicas_word_on_its_load_counts_for_load_fresh_s_and_an_open_keeps_its_prefill(monkeypatch):
    from atomr_infer.routing import channel

    monkeypatch.setattr(channel, "LOAD_FRESH_S", 3600.0)  # fresh however slow the machine, until said below
    heard = channel.ReplicaChannel(actor=None)
    assert heard.said() == (0, 0)  # nothing said yet
    heard._note_load(3, 5)
    assert heard.said() == (3, 5)
    heard._note_load(4)  # an open's answer: the load alone; the batch's prefill word stands
    assert heard.said() == (4, 5)
    monkeypatch.setattr(channel, "LOAD_FRESH_S", -1.0)  # as if LOAD_FRESH_S went by with no word
    assert heard.said() == (0, 0)


class LateOpen(FakeReplica):
    """Its ``open_many`` runs late (a large argument still on its way: Ray does not order the
    calls to an async actor), so a cancel sent after it may run first; each answer is long."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.sent, self.deliver = asyncio.Event(), asyncio.Event()

    async def _open_many(self, channel_id, requests):
        self.sent.set()
        await self.deliver.wait()
        return await super()._open_many(channel_id, requests)

    async def _answer(self, put):
        put(HttpHead(200, JSON))
        await asyncio.Event().wait()


def test_a_request_cancelled_while_its_open_is_on_its_way_is_cancelled_once_open():
    replica = LateOpen("r0")

    async def main():
        r = router(replica, refresh_s=3600)
        await r.refresh()
        stream = asyncio.create_task(answer(r.stream(*request())))
        await replica.sent.wait()
        stream.cancel()  # the client went away
        await asyncio.gather(stream, return_exceptions=True)
        replica.deliver.set()  # the open runs on the replica after the cancel was sent
        for _ in range(20):
            await asyncio.sleep(0)
        open_after = replica.hub.open_requests
        await r.aclose()
        return open_after

    assert asyncio.run(main()) == 0  # not left running in the engine
