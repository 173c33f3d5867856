"""The KV-event index (routing/kv_index.py, routing/kv_subscriber.py) fed by vLLM's own ZMQ
publisher (``vllm.distributed.kv_events.ZmqEventPublisher``, real sockets on loopback) with
batches built from vLLM's own event classes: blocks stored and evicted, a listener that starts
late and rebuilds from the replay endpoint (in full, or in part when vLLM's buffer no longer
reaches back), a replica whose events stop, and a replica that leaves."""

from __future__ import annotations

import contextlib
import itertools
import time

import pytest

from atomr_infer.routing.kv_index import SILENT_S, BlockRemoved, BlockStored, KVEventBatch, KvIndex, chain, decode_batch
from atomr_infer.routing.kv_subscriber import KvEventsHub
from tests.waiting import await_until, wait_until

_DEPLOYMENTS = itertools.count()  # kv_deployment's names

BLOCK = 4
DOC = list(range(100, 124))  # 6 blocks of 4 tokens


@pytest.fixture
def publisher(monkeypatch):
    """Start vLLM's publisher bound to loopback on ports of its own (as a replica's is)."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    from vllm.distributed.kv_events import ZmqEventPublisher

    made = []

    def start(buffer_steps: int = 100):
        pub = ZmqEventPublisher(0, "tcp://*:0", "tcp://*:0", buffer_steps=buffer_steps)
        made.append(pub)
        config = pub.get_publisher_config()
        assert config.endpoint.startswith("tcp://127.0.0.1:") and config.endpoint != "tcp://127.0.0.1:0"
        return pub, (config.endpoint, config.replay_endpoint)

    yield start
    for pub in made:
        pub.shutdown()


def stored(first: int, count: int, parent: int | None, lora: str | None = None):
    """vLLM's BlockStored for blocks ``first``..``first+count`` of DOC (vLLM's hashes: 1000 + i,
    2000 + i with the adapter: vLLM hashes the adapter's name in)."""
    from vllm.distributed.kv_events import BlockStored

    base = 1000 if lora is None else 2000
    return BlockStored(block_hashes=[base + i for i in range(first, first + count)], parent_block_hash=parent,
                       token_ids=DOC[first * BLOCK:(first + count) * BLOCK], block_size=BLOCK, lora_id=None,
                       medium="GPU", lora_name=lora)


def batch(*events):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=list(events))


def wait_for(check, timeout_s: float = 10.0):
    wait_until(check, timeout_s, 0.02)


def test_our_structures_decode_what_vllm_encodes():
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    sent = batch(stored(0, 2, None, lora="pirate"), BlockRemoved(block_hashes=[1001], medium="GPU"), AllBlocksCleared())
    got = decode_batch(msgspec.msgpack.Encoder().encode(sent))
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (got.events[0].block_hashes, got.events[0].token_ids, got.events[0].lora_name) == (
        [2000, 2001], DOC[:8], "pirate")
    assert got.events[1].block_hashes == [1001]


def test_stored_and_evicted_blocks_as_a_late_listener_rebuilds_them_from_the_replay(publisher):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    pub, endpoints = publisher()
    pub.publish(batch(stored(0, 2, None)))  # before anyone listens: only the replay has it
    pub.publish(batch(stored(2, 2, 1001), stored(0, 1, None, lora="pirate")))
    hub = KvEventsHub()
    hub.follow("d", {"r0": endpoints})
    index = hub.index("d")
    doc = chain(DOC, BLOCK)
    wait_for(lambda: index.depths(doc, ["r0"]) == {"r0": 4})
    assert index.depths(chain(DOC, BLOCK, "pirate"), ["r0"]) == {"r0": 1}  # the adapter's blocks apart
    pub.publish(batch(BlockRemoved(block_hashes=[1002], medium="GPU")))  # evicted: the prefix ends before it
    wait_for(lambda: index.depths(doc, ["r0"]) == {"r0": 2})
    assert index.depths(doc, {"r1"}) == {} and index.depths(doc[:1]) == {"r0": 1}
    pub.publish(batch(AllBlocksCleared()))
    wait_for(lambda: index.depths(doc) == {})
    hub.follow("d", {})  # the replica left: nothing of it remains
    wait_for(lambda: index.blocks_of("r0") == 0 and "r0" not in index.heard_at)


def test_a_replay_that_no_longer_reaches_back_is_partial_never_wrong(publisher):
    pub, endpoints = publisher(buffer_steps=2)
    pub.publish(batch(stored(0, 2, None)))  # out of the buffer by the time we listen
    pub.publish(batch(stored(2, 1, 1001)))
    pub.publish(batch(stored(3, 1, 1002)))
    # vLLM's thread marks a batch done once sent and buffered: all three, before the listener starts.
    wait_for(lambda: pub._event_queue.unfinished_tasks == 0)
    hub = KvEventsHub()
    hub.follow("d", {"r0": endpoints})
    index = hub.index("d")
    wait_for(lambda: index.events >= 2)
    # Blocks 2 and 3 chain on blocks vLLM stored before its buffer begins: unknown, so unused.
    assert index.depths(chain(DOC, BLOCK)) == {} and index.skipped == 2
    pub.publish(batch(stored(0, 1, None)))  # a new run from the start is usable again
    wait_for(lambda: index.depths(chain(DOC, BLOCK), ["r0"]) == {"r0": 1})


def test_a_replica_owing_events_is_silent_until_it_reports_again():
    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch

    index = KvIndex()
    index.expect("r0", now=100.0)
    assert not index.silent("r0", now=100.0 + SILENT_S - 0.1)
    assert index.silent("r0", now=100.0 + SILENT_S + 0.1) and not index.silent("r1", now=200.0)
    index.apply("r0", KVEventBatch(0.0, [BlockStored([1], None, DOC[:BLOCK], BLOCK)]), now=106.0)
    assert not index.silent("r0", now=200.0)
    assert index.depths(chain(DOC, BLOCK), ["r0"]) == {"r0": 1}


def test_the_picker_takes_the_deepest_holder_within_the_load_bound_and_falls_back_without_fresh_events(
    monkeypatch,
):
    from atomr_infer.routing import kv_index
    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch
    from atomr_infer.routing.kv_subscriber import hub
    from atomr_infer.routing.picker import PromptIds, ReplicaPicker
    from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute

    monkeypatch.setattr(kv_index, "SILENT_S", 3600.0)  # not overdue however slow the machine, until said below
    source = ("tcp://127.0.0.1:9", None, BLOCK)  # nothing listens there: events go into the index directly
    routes = [ReplicaRoute(f"r{i}", f"atomr:kv:r{i}", None, kv_events=source) for i in range(3)]
    dep = DeploymentRoute("kv", 8, "queue", tuple(routes), policy="kv_events")
    r0, r1, r2 = (r.actor_name for r in routes)
    index = hub().index("kv")
    index.apply(r1, KVEventBatch(0.0, [BlockStored([1, 2, 3], None, DOC[:3 * BLOCK], BLOCK)]))
    index.apply(r2, KVEventBatch(0.0, [BlockStored([7], None, DOC[:BLOCK], BLOCK)]))
    picker = ReplicaPicker()

    def pick(loads, tokens=DOC):
        choice = picker.pick(dep, routes, {r.actor_name: loads.get(r.actor_name, 0) for r in routes},
                             lambda: None, tokens=None if tokens is None else PromptIds("", tokens))
        return choice.actor_name

    assert pick({}) == r1  # 3 blocks held
    assert pick({r1: 6}) == r2  # r1 above the bound: the next deepest under it
    assert pick({r1: 6, r2: 6}) == r0  # every holder above it: the least loaded
    other = [t + 1000 for t in DOC]
    assert pick({r0: 1, r2: 1}, other) == r1  # held nowhere: placed (prefix affinity: the least loaded)
    assert pick({}, None) == r0  # tokens unknown here (no tokenizer yet): prefix affinity
    assert dict(picker.reasons) == {("kv", "kv_hit"): 2, ("kv", "kv_overflow"): 1, ("kv", "kv_miss"): 1,
                                    ("kv", "fallback_no_affinity"): 1}
    # Each was sent blocks it did not hold and owes an event: once that is overdue, none is trusted.
    monkeypatch.setattr(kv_index, "SILENT_S", -1.0)
    assert all(index.silent(name) for name in (r0, r1, r2))
    assert pick({r0: 1}) == r1 and picker.reasons["kv", "fallback_no_affinity"] == 2



def test_new_conversations_over_a_system_prompt_every_replica_holds_spread_over_the_replicas(monkeypatch):
    """Every replica holds the shared system prompt, none the rest: a tie, which went to the
    replica with the smallest name, so at low load (or with many routers, each with little
    traffic) every new conversation landed on one replica. Now by the conversation's rendezvous
    order: spread, and each conversation to the same replica from every router."""
    from atomr_infer.routing import kv_index
    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch
    from atomr_infer.routing.kv_subscriber import hub
    from atomr_infer.routing.picker import PromptIds, ReplicaPicker
    from atomr_infer.routing.prefix import prompt_key
    from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute

    monkeypatch.setattr(kv_index, "SILENT_S", 3600.0)
    source = ("tcp://127.0.0.1:9", None, BLOCK)
    routes = [ReplicaRoute(f"r{i}", f"atomr:kvtie:r{i}", None, kv_events=source) for i in range(4)]
    dep = DeploymentRoute("kvtie", 8, "queue", tuple(routes), policy="kv_events")
    index = hub().index("kvtie")
    for route in routes:  # the system prompt's 2 blocks, held everywhere
        index.apply(route.actor_name, KVEventBatch(0.0, [BlockStored([1, 2], None, DOC[:2 * BLOCK], BLOCK)]))

    def pick(picker, i):
        chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Question {i}?"}]
        ids = DOC[:2 * BLOCK] + [1000 + i] * 3 * BLOCK  # the system prompt, then this conversation's own
        choice = picker.pick(dep, routes, {}, lambda: prompt_key(chat), tokens=PromptIds("", ids))
        picker.answered(choice.actor_name, picker.take_work(choice.actor_name))  # answered before the next
        return choice.actor_name

    one, another = ReplicaPicker(), ReplicaPicker()
    picked = [pick(one, i) for i in range(20)]
    assert len(set(picked)) > 1, picked
    assert [pick(one, i) for i in range(20)] == picked == [pick(another, i) for i in range(20)]
    assert dict(one.reasons) == {("kvtie", "kv_hit"): 40}


@pytest.mark.parametrize("runtime, field, says", [
    ({"enable_prefix_caching": False}, "runtime_config.enable_prefix_caching",
     "is false but routing.policy is kv_events"),
    ({"extra_engine_args": {"kv_events_config": {"enable_kv_cache_events": True}}},
     "runtime_config.extra_engine_args.kv_events_config", "is set but routing.policy is kv_events, for which atomr"),
])
def test_kv_events_is_refused_where_the_replicas_cannot_publish_for_atomr(runtime, field, says):
    from atomr_infer.engine.vllm.kv_events import publishes
    from atomr_infer.errors import SpecError
    from atomr_infer.spec import Deployment, parse_deployment

    base = {"name": "d", "model": "bundled:smollm2-135m-instruct", "device": "cpu", "runtime_config": runtime}
    with pytest.raises(SpecError, match=f"{field}: {says}"):  # one line naming the field
        parse_deployment({**base, "routing": {"policy": "kv_events"}})
    assert not publishes(Deployment.model_validate(base))  # and such replicas publish nothing
    assert publishes(Deployment.model_validate({**base, "runtime_config": {}}))


def test_a_gap_asks_for_a_replay_from_the_first_missing_batch_and_a_lost_one_rebuilds():
    """The listener's sequence logic, fed by hand (batch 1 lost between 0 and 2); its replay
    requests go to a port nothing listens on."""
    import msgspec
    import zmq

    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch
    from atomr_infer.routing.kv_subscriber import END_SEQ, _Follower

    def frame(seq, first, count, parent):
        hashes = list(range(1000 + first, 1000 + first + count))
        batch = KVEventBatch(0.0, [BlockStored(hashes, parent, DOC[first * BLOCK:(first + count) * BLOCK], BLOCK)])
        return seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)

    def end(follower):
        hub._on_replay(follower, [b"", b"", END_SEQ, b""])

    doc = chain(DOC, BLOCK)
    hub = KvEventsHub()
    hub._context, hub._poller = zmq.Context.instance(), zmq.Poller()
    follower = _Follower("d", "r0", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")
    batches = [frame(0, 0, 1, None), frame(1, 1, 1, 1000), frame(2, 2, 1, 1001)]
    hub._on_sub(follower, [b"", *batches[0]])
    hub._on_sub(follower, [b"", *batches[2]])  # 1 is missing: held, and a replay asked from 1
    assert follower.replay_from == 1 and hub.gaps == 1 and hub.index("d").depths(doc) == {"r0": 1}
    hub._on_replay(follower, [b"", b"", *batches[1]])
    end(follower)
    assert follower.last == 2 and hub.index("d").depths(doc) == {"r0": 3} and hub.partial == 0

    # Batches 3 and 4 missing, and no replay has them: asked for twice, then lost for good.
    hub._on_sub(follower, [b"", 5 .to_bytes(8, "big"), batches[0][1]])
    assert follower.replay_from == 3
    end(follower)
    assert follower.replay_from == 3 and follower.replaying_since is not None  # asked once more
    end(follower)
    assert follower.last == 5 and hub.partial == 1
    assert hub.index("d").depths(doc) == {"r0": 1}  # rebuilt: only what batch 5 stored
    for sock in (follower.sub, follower.dealer):
        hub._close(sock)


def test_a_holder_busy_prefilling_loses_to_a_replica_that_would_finish_sooner():
    from atomr_infer.routing.kv_policy import QUEUED_BLOCK_WEIGHT, pick_by_depth
    from atomr_infer.routing.table import ReplicaRoute

    a, b = (ReplicaRoute(n, n, None) for n in ("a", "b"))

    def place():
        raise AssertionError("a replica holds the prompt: nothing to place")

    # 10 blocks, 4 held on a: a costs 6 blocks of prefill plus what waits there, b all 10.
    assert pick_by_depth([a, b], {}, 8, {"a": 4}, place, blocks=10) == (a, "kv_hit")
    busy = {"a": (4 + 1) / QUEUED_BLOCK_WEIGHT}  # prefill queued at a: more than the 4 blocks it saves
    assert pick_by_depth([a, b], {}, 8, {"a": 4}, place, blocks=10, queued=busy) == (b, "kv_overflow")


def test_mid_roll_to_another_model_the_new_models_tokenizer_and_replicas_are_used():
    """A prompt is tokenized with the tokenizer of the model the deployment rolls to, wherever its
    replica is listed, and only replicas serving that model are matched: an old one holding the
    same ids is no holder (its model's ids would differ). Where only old replicas are usable, the
    old model's tokenizer and replicas."""
    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch
    from atomr_infer.routing.kv_subscriber import hub
    from atomr_infer.routing.picker import PromptIds, ReplicaPicker, tokenizer_source
    from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute

    source = ("tcp://127.0.0.1:9", None, BLOCK)  # nothing listens there: events go into the index directly
    old = ReplicaRoute("o", "atomr:kvroll:o", None, kv_events=source, model="org/model-1")
    new = ReplicaRoute("n", "atomr:kvroll:n", None, kv_events=source, model="org/model-2")
    dep = DeploymentRoute("kvroll", 8, "queue", (old, new), policy="kv_events", model="org/model-2")
    assert tokenizer_source(dep, [old, new]) is new and tokenizer_source(dep, [old]) is old
    hub().index("kvroll").apply(old.actor_name, KVEventBatch(0.0, [BlockStored([1, 2, 3], None, DOC[:3 * BLOCK],
                                                                               BLOCK)]))
    picker = ReplicaPicker()
    loads = {new.actor_name: 0, old.actor_name: 1}
    assert picker.pick(dep, [old, new], loads, lambda: None, tokens=PromptIds("org/model-2", DOC)) is new
    assert dict(picker.reasons) == {("kvroll", "kv_miss"): 1}
    # The same ids from the old model's tokenizer: its replica holds them.
    assert picker.pick(dep, [old, new], loads, lambda: None, tokens=PromptIds("org/model-1", DOC)) is old
    assert picker.reasons["kvroll", "kv_hit"] == 1


def test_a_tokenizer_per_model_fetched_from_a_replica_serving_it_and_forgotten_once_none_does():
    import asyncio
    import concurrent.futures
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers

    from atomr_infer.routing.prompt_tokens import TokenizerCache

    def files(first_id: int) -> dict[str, str]:
        tokenizer = Tokenizer(models.WordLevel({"hello": first_id, "[UNK]": first_id + 1}, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        return {"tokenizer.json": tokenizer.to_str()}

    fetched: list[int] = []

    def replica(first_id: int):
        def remote():
            fetched.append(first_id)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(files(first_id))
            return SimpleNamespace(future=lambda: done)

        return SimpleNamespace(tokenizer_files=SimpleNamespace(remote=remote))

    async def ready(cache, actor, model):
        for _ in range(200):
            found = cache.get("d", actor, model)
            if found is not None:
                return found
            await asyncio.sleep(0.01)
        raise AssertionError(f"no tokenizer for {model}")

    async def main():
        cache = TokenizerCache()
        old, new = replica(5), replica(50)
        assert (await ready(cache, old, "m1")).tokens("hello") == [5]
        assert (await ready(cache, new, "m2")).tokens("hello") == [50]  # a roll: from a replica of the new model
        # Mid-roll both are kept: requests that can use only an old replica do not fetch again.
        assert cache.get("d", old, "m1").tokens("hello") == [5] and fetched == [5, 50]
        elsewhere = cache._ready[("e", "m9")] = object()  # another table's deployment: not named, left alone
        cache.retain({"d": {"m2"}, "other": set()})  # the roll is done: no replica serves m1
        assert cache._ready[("e", "m9")] is elsewhere
        assert cache.get("d", new, "m2") is not None and cache.get("d", old, "m1") is None  # forgotten
        while ("d", "m1") in cache._fetching:  # a router on an older table asked for m1 again: fetched...
            await asyncio.sleep(0.01)
        assert cache.get("d", old, "m1") is None and fetched == [5, 50, 5]  # ...and not kept
        cache.retain({"d": {"m1", "m2"}})  # served again (a roll back)
        cache._failed_at.clear()  # as RETRY_S later
        assert (await ready(cache, old, "m1")).tokens("hello") == [5] and fetched == [5, 50, 5, 5]

    asyncio.run(main())


@contextlib.contextmanager
def kv_deployment(*replicas):
    """A deployment over ``replicas`` with policy kv_events, the first holding 2 of the 6 blocks
    of ``prompt`` (4 to prefill there); yields (its name, its routes, a table source, ``prompt``).

    Each gets a name of its own: the hub's thread forgets the last one's index when it gets to
    it, which may be after this one wrote its blocks into an index of the same name."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from atomr_infer.routing import channel, kv_index
    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch
    from atomr_infer.routing.kv_subscriber import hub
    from atomr_infer.routing.prompt_tokens import PromptTokenizer, tokenizers
    from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable

    name = f"kvq{next(_DEPLOYMENTS)}"
    vocab = Tokenizer(models.WordLevel({f"t{i}": i for i in DOC} | {"[UNK]": 0}, unk_token="[UNK]"))
    vocab.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizers()._ready[(name, "m")] = PromptTokenizer({"tokenizer.json": vocab.to_str()})
    source = ("tcp://127.0.0.1:9", None, BLOCK)  # nothing listens there: events go into the index directly
    routes = tuple(ReplicaRoute(r.name, f"atomr:{name}:{r.name}", r, kv_events=source, model="m") for r in replicas)
    table = RoutingTable(1, {name: DeploymentRoute(name, 8, "queue", routes, policy="kv_events", model="m")})
    hub().index(name).apply(routes[0].actor_name, KVEventBatch(0.0, [BlockStored([1, 2], None, DOC[:2 * BLOCK],
                                                                                  BLOCK)]))

    async def source_of(version):
        return table if version != table.version else None

    # These replicas never report the blocks they are sent, so after SILENT_S the index would
    # rightly call them silent and the policy fall back, and a replica's word is forgotten after
    # LOAD_FRESH_S; a loaded machine (CI) can take that long between two steps of one test.
    # Both have tests of their own.
    kept = kv_index.SILENT_S, channel.LOAD_FRESH_S
    kv_index.SILENT_S = channel.LOAD_FRESH_S = 3600.0
    try:
        yield name, routes, source_of, " ".join(f"t{i}" for i in DOC)
    finally:
        kv_index.SILENT_S, channel.LOAD_FRESH_S = kept
        tokenizers()._ready.pop((name, "m"), None)
        hub().forget(name)  # (followed by the routers' pickers)


def test_prefill_waiting_counts_until_the_first_output_and_every_router_hears_the_replicas_total():
    """kv_events: a request's prefill counts as waiting on its replica until its first output (the
    head of a stream leaves before the engine prefilled: not then), in the router that sent it
    and in the replica, whose batches tell every router with requests there the total."""
    import asyncio

    from atomr_infer.routing.router import Router
    from atomr_infer.wire import HttpHead

    from .fakes import JSON, GatedReplica, request

    class HeadFirst(GatedReplica):  # as a stream: the head at once, the first token once prefilled
        async def _answer(self, put):
            put(HttpHead(200, JSON))
            await self.gate.wait()
            put(f"from {self.name}".encode())

    holder, other = HeadFirst("h"), HeadFirst("o")

    async def main(dep, routes, source_of, prompt):
        async def head_of(router):
            items = router.stream(*request(dep, prompt))
            assert isinstance(await items.__anext__(), HttpHead)
            return items

        a, b = Router(source_of, refresh_s=0.0), Router(source_of, refresh_s=0.0)
        first = await head_of(a)
        name = routes[0].actor_name
        assert a.route_reasons[dep, "kv_hit"] == 1 and holder.hub.waiting_prefill == 4
        assert a._picker._queued[name] == 4  # the head is no answer: still prefilling
        second = await head_of(b)  # b's own 4, and a's 4 the replica tells it of
        assert b.route_reasons[dep, "kv_hit"] == 1 and holder.hub.waiting_prefill == 8
        assert b._prefill_waiting(name) == 8 and b._picker._queued[name] == 4
        third = await head_of(b)
        assert holder.hub.waiting_prefill == 12 and b._prefill_waiting(name) == 12 and b._picker._queued[name] == 8
        b._channels[name]._note_load(3)  # an open's answer (the load alone, which may come after a batch)...
        assert b._prefill_waiting(name) == 12  # ...does not erase the replica's word
        holder.gate.set()
        for items in (first, second, third):
            assert [item async for item in items] == [b"from h"]
        assert holder.hub.waiting_prefill == 0 and not a._picker._queued and not b._picker._queued

    with kv_deployment(holder, other) as deployment:
        asyncio.run(main(*deployment))


def test_a_whole_answers_prefill_stops_waiting_when_the_replica_says_its_prompt_is_computed():
    """An answer not streamed has no output before its last: the replica tells the router that
    sent it, in a batch of its own, when the engine computed the prompt (``prefilled``), so
    neither counts it as waiting any longer; its end then hands nothing back twice."""
    import asyncio

    from atomr_infer.routing.router import Router

    from .fakes import GatedReplica, request

    class Whole(GatedReplica):
        def __init__(self, name):
            super().__init__(name)
            self.computed = asyncio.Event()

        async def _serve(self, request, put, tokens, resume=None, prefilled=None):
            await self.computed.wait()
            prefilled()  # as the engine's step loop does (engine/vllm/prefill_watch.py)
            await self._answer(put)

    holder = Whole("h")

    async def main(dep, routes, source_of, prompt):
        async def until(check):  # a liveness bound, not a speed target (routing tokenizes in a thread)
            await await_until(check, 10, 0.005)

        a = Router(source_of, refresh_s=0.0)
        whole = asyncio.ensure_future(_drain(a.stream(*request(dep, prompt))))
        name = routes[0].actor_name
        await until(lambda: holder.hub.waiting_prefill == 4 and a._picker._queued[name] == 4)
        holder.computed.set()
        await until(lambda: holder.hub.waiting_prefill == 0 and not a._picker._queued)
        assert not whole.done()  # the answer itself is still to come
        holder.computed.clear()
        second = asyncio.ensure_future(_drain(a.stream(*request(dep, prompt))))
        await until(lambda: a._picker._queued.get(name) == 4)
        holder.gate.set()  # the first answer ends: its router already handed its 4 blocks back
        assert await whole == [b"from h"]
        assert a._picker._queued[name] == 4 and holder.hub.waiting_prefill == 4  # the second's, untouched
        holder.computed.set()
        assert await second == [b"from h"]
        assert holder.hub.waiting_prefill == 0 and not a._picker._queued

    with kv_deployment(holder) as deployment:
        asyncio.run(main(*deployment))


async def _drain(items):
    """A request's body pieces (its head left out)."""
    from atomr_infer.wire import HttpHead

    return [item async for item in items if not isinstance(item, HttpHead)]


def test_a_request_cancelled_before_its_first_step_leaves_nothing_counted_on_the_channel():
    """A router's cancel can reach a request the replica started but the loop has not yet run:
    its task never enters ``_pump``, yet it is forgotten, its prefill no longer waiting."""
    import asyncio

    from atomr_infer.replica.channel import Channel
    from atomr_infer.wire import HttpRequest, OpenRequest

    async def serve(http, put, tokens, resume, prefilled):  # never reached
        raise AssertionError("a request cancelled before its first step ran")

    async def main():
        channel = Channel(lambda: 0)
        channel.start(OpenRequest("r1", HttpRequest("POST", "/v1/completions", (), b"{}"), prefill_blocks=5), serve)
        assert channel.open_requests == 1 and channel.waiting_prefill == 5
        channel.cancel(["r1"])  # in the same turn of the loop: the task has not stepped
        for _ in range(3):
            await asyncio.sleep(0)
        assert channel.open_requests == 0 and channel.waiting_prefill == 0

    asyncio.run(main())



def test_a_hybrid_models_window_group_evicting_its_copy_keeps_the_full_attention_one():
    """Every KV-cache group of a hybrid model (full attention + sliding window) stores the same
    hashes; the window's blocks go while the request runs. Removing that copy forgot the block,
    and the next store chaining from it was skipped: hits lost."""
    index, chained = KvIndex(), chain(DOC, BLOCK)
    for group in (0, 1):
        index.apply("r1", KVEventBatch(0.0, [BlockStored([1000, 1001, 1002, 1003], None, DOC[:16], BLOCK,
                                                         group_idx=group)]))
    index.apply("r1", KVEventBatch(0.0, [BlockRemoved([1000, 1001], group_idx=1)]))
    assert index.depths(chained) == {"r1": 4}
    index.apply("r1", KVEventBatch(0.0, [BlockStored([1004], 1003, DOC[16:20], BLOCK, group_idx=0)]))
    assert index.depths(chained) == {"r1": 5} and index.skipped == 0
    index.apply("r1", KVEventBatch(0.0, [BlockRemoved([1000], group_idx=0)]))
    assert index.depths(chained) == {}  # gone from every group
    # An offload tier's copy (medium CPU) is not the device's prefix cache: neither stored nor removed.
    index.apply("r2", KVEventBatch(0.0, [BlockStored([1000], None, DOC[:4], BLOCK, medium="CPU")]))
    assert index.depths(chained) == {}


def test_a_hash_stored_again_for_other_tokens_releases_its_old_entry():
    """The overwritten entry stayed held for good: removals and drop() could not reach it, and a
    prompt matched blocks the replica no longer had (a false hit)."""
    index, chained = KvIndex(), chain(DOC, BLOCK)
    index.apply("r1", KVEventBatch(0.0, [BlockStored([1000, 1001], None, DOC[:8], BLOCK)]))
    other = [t + 1 for t in DOC[:8]]
    index.apply("r1", KVEventBatch(0.0, [BlockStored([1000, 1001], None, other, BLOCK)]))
    assert index.depths(chained) == {} and index.depths(chain(other, BLOCK)) == {"r1": 2}
    index.drop("r1")
    assert len(index) == 0
    # Tokens that are not one block per hash (a placeholder: no tokens, block size 0) are skipped.
    index.apply("r1", KVEventBatch(0.0, [BlockStored([1000], None, [], 0), BlockStored([1000], None, DOC[:8], BLOCK)]))
    assert len(index) == 0 and index.skipped == 2


# A Qwen2.5-style template that renders tools first and tool calls' arguments with tojson.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for call in message.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' }}{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{% generation %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endgeneration %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_chat_with_tools_and_tool_calls_is_rendered_as_vllm_renders_it(bundled_model_dir):
    """The router rendered tools as none, a tool call's JSON-string arguments quoted again, and
    jinja2's own tojson (keys sorted, HTML characters escaped): an agent's chat matched no block
    after its first tool call (none at all where the template puts the tools first). The same
    conversation through vLLM's own steps (its tool model's dump, its message post-processing,
    transformers' template environment) now gives the same text, token for token."""
    import copy

    from transformers.utils.chat_template_utils import _compile_jinja_template
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.renderers.chat_utils import _postprocess_messages

    from atomr_infer.routing.prompt_tokens import PromptTokenizer
    from atomr_infer.wire import RoutingFacts

    tools = [{"type": "function", "function": {"name": "weather", "description": "Now & <soon>",
                                                "parameters": {"type": "object", "properties": {"city": {}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris & <O'Hare>?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"unit": "c", "city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    facts = RoutingFacts.of("/v1/chat/completions", {"model": "d", "messages": messages, "tools": tools})
    vocabulary = (bundled_model_dir / "tokenizer.json").read_text()
    files = {"tokenizer.json": vocabulary, "chat_template.jinja": TOOLS_TEMPLATE}
    ours = PromptTokenizer(files).tokens(facts.prompt, facts.template)

    theirs_messages = copy.deepcopy(messages)
    theirs_messages[0]["content"], theirs_messages[1]["content"] = messages[0]["content"], ""
    theirs_messages[3]["content"] = "And tomorrow?"
    _postprocess_messages(theirs_messages)
    text = _compile_jinja_template(TOOLS_TEMPLATE).render(
        messages=theirs_messages, add_generation_prompt=True,
        tools=[ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools])
    from tokenizers import Tokenizer

    assert '"arguments": {"unit": "c", "city": "Paris"}' in text and "Now & <soon>" in text
    assert ours == Tokenizer.from_str(vocabulary).encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "a"}},
    {"type": "function", "function": {"name": "a", "strict": True, "description": None}, "defer_loading": True},
    {"type": "function", "function": {"name": "a", "extra": 1, "parameters": {"type": "object"}}, "other": 2},
])
def test_tools_are_the_dicts_vllms_tool_model_dumps(tool):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    from atomr_infer.routing.prompt_tokens import _tool_dicts

    assert _tool_dicts([tool]) == [ChatCompletionToolsParam.model_validate(tool).model_dump()]


def test_the_tokenizers_of_a_deployment_gone_or_routing_by_another_policy_are_forgotten():
    """A tokenizer is tens of MB: kept for every deployment a process ever routed by kv_events,
    they grew without end."""
    from atomr_infer.routing.picker import ReplicaPicker
    from atomr_infer.routing.prompt_tokens import tokenizers
    from atomr_infer.routing.table import DeploymentRoute, RoutingTable

    def dep(name, policy):
        return DeploymentRoute(name, 8, "queue", policy=policy, model=f"org/{name}")

    cache = tokenizers()
    for name in ("gone", "other", "kept"):
        cache._ready[(f"tok-{name}", f"org/tok-{name}")] = object()  # as if fetched from a replica
    picker = ReplicaPicker()
    picker.table_changed(RoutingTable(1, {f"tok-{n}": dep(f"tok-{n}", "kv_events") for n in ("gone", "other", "kept")}))
    picker.table_changed(RoutingTable(2, {"tok-other": dep("tok-other", "power_of_two"),
                                          "tok-kept": dep("tok-kept", "kv_events")}))
    assert sorted(k for k in cache._ready if k[0].startswith("tok-")) == [("tok-kept", "org/tok-kept")]
    picker.table_changed(RoutingTable(3, {}))
    assert not [k for k in cache._ready if k[0].startswith("tok-")]


def test_a_prompt_stored_under_a_cache_salt_matches_only_requests_with_that_salt():
    """vLLM hashes a request's ``cache_salt`` into its first block (and an image's identifier or
    prompt embeddings' digest into theirs), and lists them in the event's ``extra_keys``, one
    entry per block as ``to_event_extra_keys`` (vllm/v1/core/kv_cache_utils.py; importing it
    costs torch) untags them: the adapter's name first, a salt bare, an image as (identifier,
    offset). A tenant's prompt cached under its salt is no cache hit for another tenant, nor
    for a request without a salt."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored as VllmStored

    def stored(extra, lora=None):
        return VllmStored(block_hashes=[1000, 1001, 1002], parent_block_hash=None, token_ids=DOC[:3 * BLOCK],
                          block_size=BLOCK, lora_id=None, medium="GPU", lora_name=lora, extra_keys=extra)

    salted = [("tenant-a",), None, None]
    with_adapter = [("d:pirate", "tenant-a"), ("d:pirate",), ("d:pirate",)]
    image = [None, (("img-hash", 2),), None]  # an image in the second block
    index = KvIndex()
    for replica, event in (("salted", stored(salted)), ("adapter", stored(with_adapter, "d:pirate")),
                           ("image", stored(image))):
        index.apply(replica, decode_batch(msgspec.msgpack.encode(batch(event))))
    assert index.depths(chain(DOC, BLOCK)) == {"image": 1}  # no salt: only the text before the image
    assert index.depths(chain(DOC, BLOCK, salt="tenant-b")) == {}
    assert index.depths(chain(DOC, BLOCK, salt="tenant-a")) == {"salted": 3}
    assert index.depths(chain(DOC, BLOCK, "d:pirate", salt="tenant-a")) == {"adapter": 3}
    assert index.depths(chain(DOC, BLOCK, "d:pirate")) == {}


def test_the_router_matches_a_request_by_its_cache_salt():
    """The salt is read at the edge with the routing facts and folded into the prompt's first
    block: the unsalted holder of the fixture's prompt is no holder for a salted request."""
    import asyncio

    from atomr_infer.routing.kv_index import BlockStored, KVEventBatch
    from atomr_infer.routing.kv_subscriber import hub
    from atomr_infer.routing.router import Router
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import FakeReplica

    def request(dep, prompt, salt=None):
        data = {"model": dep, "prompt": prompt, **({"cache_salt": salt} if salt else {})}
        return RoutingFacts.of("/v1/completions", data), HttpRequest("POST", "/v1/completions", (), b"{}")

    async def main(dep, routes, source_of, prompt):
        salted = routes[1].actor_name  # holds the prompt's first 3 blocks under the salt "a"
        hub().index(dep).apply(salted, KVEventBatch(0.0, [BlockStored(
            [7, 8, 9], None, DOC[:3 * BLOCK], BLOCK, extra_keys=[["a"], None, None])]))
        router = Router(source_of, refresh_s=0.0)
        for salt, holder in ((None, replicas[0]), ("a", replicas[1])):
            assert request(dep, prompt, salt)[0].cache_salt == salt
            calls = holder.calls
            await _drain(router.stream(*request(dep, prompt, salt)))
            assert holder.calls == calls + 1, salt
        assert dict(router.route_reasons) == {(dep, "kv_hit"): 2}
        await _drain(router.stream(*request(dep, prompt, "b")))  # held under no salt "b"
        assert router.route_reasons[dep, "kv_miss"] == 1
        await router.aclose()

    replicas = [FakeReplica("h"), FakeReplica("s"), FakeReplica("o")]
    with kv_deployment(*replicas) as deployment:
        asyncio.run(main(*deployment))


def test_responses_and_messages_requests_are_not_matched_by_tokens_the_router_cannot_render():
    """A Responses request's input string was tokenized as plain text (vLLM renders it as a chat,
    with its instructions), a Messages request's messages without its system field: token ids no
    replica's cache holds, so every such request missed. They are routed without token ids now."""
    import asyncio

    from atomr_infer.routing.router import Router
    from atomr_infer.wire import HttpRequest, RoutingFacts

    from .fakes import FakeReplica

    async def main(dep, routes, source_of, prompt):
        router = Router(source_of, refresh_s=0.0)
        for path, data in (("/v1/responses", {"input": prompt, "instructions": "Be brief."}),
                           ("/v1/messages", {"system": "Be brief.", "max_tokens": 5,
                                             "messages": [{"role": "user", "content": prompt}]})):
            facts = RoutingFacts.of(path, {"model": dep, **data})
            assert facts.prompt is not None  # read as ever (prefix affinity keys on it)
            await _drain(router.stream(facts, HttpRequest("POST", path, (), b"{}")))
        reasons = {reason for (_, reason) in router.route_reasons}
        assert not reasons & {"kv_hit", "kv_miss"}, dict(router.route_reasons)
        await router.aclose()

    replicas = [FakeReplica("h"), FakeReplica("s"), FakeReplica("o")]
    with kv_deployment(*replicas) as deployment:
        asyncio.run(main(*deployment))


def test_a_roll_that_changes_only_the_chat_template_gets_routers_a_new_tokenizer():
    """Routers kept a tokenizer per model: a roll to another chat template (or default template
    arguments) of the same model left every router rendering chats with the old one, so every
    chat missed. Replicas now say what they render with, and routers key their tokenizer by it."""
    import asyncio

    from tokenizers import Tokenizer, models, pre_tokenizers

    from atomr_infer.routing.picker import ReplicaPicker
    from atomr_infer.routing.prompt_tokens import PromptTokenizer, tokenizers
    from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
    from atomr_infer.wire import RoutingFacts

    def tokenizer(first_id: int) -> PromptTokenizer:
        vocab = Tokenizer(models.WordLevel({"hello": first_id, "[UNK]": 0}, unk_token="[UNK]"))
        vocab.pre_tokenizer = pre_tokenizers.Whitespace()
        return PromptTokenizer({"tokenizer.json": vocab.to_str()})

    name, source = "kvtemplate", ("tcp://127.0.0.1:9", None, BLOCK)
    tokenizers()._ready[(name, "m#old")] = tokenizer(5)  # as fetched from a replica of each (in turn)
    old = ReplicaRoute("o", f"atomr:{name}:o", None, kv_events=source, model="m", renders="old")
    new = ReplicaRoute("n", f"atomr:{name}:n", None, kv_events=source, model="m", renders="new")
    facts = RoutingFacts.of("/v1/completions", {"model": name, "prompt": "hello"})
    picker = ReplicaPicker()

    def ids(replica: ReplicaRoute) -> list[int]:
        dep = DeploymentRoute(name, 8, "queue", (replica,), policy="kv_events", model="m")
        picker.table_changed(RoutingTable(1, {name: dep}))
        return asyncio.run(picker.prompt_tokens(dep, [replica], facts)).ids

    assert ids(old) == [5]
    tokenizers()._ready[(name, "m#new")] = tokenizer(50)
    assert ids(new) == [50]
    assert (name, "m#old") not in tokenizers()._ready  # no replica renders with it any more
    picker.table_changed(RoutingTable(2, {}))


def test_a_few_requests_a_second_ask_vllm_to_report_their_cached_prefix_in_full():
    """vLLM publishes only blocks it computes: a router that missed a cached prefix's events never
    placed what is stored on top of it. FullReports marks at most 4 requests a second for vLLM to
    publish their cached prefix again (kv_cache_report_mode, read by vLLM's Request from
    sampling_params.extra_args); the rest are left as they are. The e2e test sees a router heal."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from atomr_infer.engine.vllm.kv_events import FullReports

    now = [100.0]
    reports = FullReports(per_second=4, clock=lambda: now[0])
    requests = [SimpleNamespace(sampling_params=SamplingParams(extra_args={"mine": 1} if i == 0 else None))
                for i in range(10)]
    for request in requests[:6]:
        reports.mark(request)
    now[0] += 1.0
    for request in requests[6:]:
        reports.mark(request)
    modes = [(r.sampling_params.extra_args or {}).get("kv_cache_report_mode") for r in requests]
    assert modes == ["full"] * 4 + [None, None] + ["full"] * 4
    assert requests[0].sampling_params.extra_args["mine"] == 1  # a request's own extra_args are kept
    reports.mark(SimpleNamespace(sampling_params=None))  # pooling: nothing to mark
