"""prefix_affinity routing: prompt keys, the choice, and through ``Router.stream`` with replica
fakes. The policy against simulated caches at scale: scripts/sim_routing.py; against vLLM's
real prefix cache: scripts/bench_prefix_routing.py."""

from __future__ import annotations

import asyncio
import json

from atomr_infer.routing.prefix import PrefixIndex, block_hashes, pick_prefix_affinity, rendezvous_order
from atomr_infer.routing.prefix import prompt_key as key_of
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.wire import HttpRequest, RequestKind, RoutingFacts

from .fakes import FakeReplica, route


def prompt_key(request):
    """The prefix key of a request body, through the facts the edge parses from it."""
    data = json.loads(request.body) if isinstance(request, HttpRequest) else {"model": "d", **request}
    return key_of(RoutingFacts.of("/v1/chat/completions", data).prompt)

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 40}


def chat(*turns: str) -> HttpRequest:
    said = [{"role": "user" if i % 2 == 0 else "assistant", "content": t * 150} for i, t in enumerate(turns)]
    messages = [SYSTEM, *said]
    body = json.dumps({"model": "d", "messages": messages}).encode()
    return HttpRequest("POST", "/v1/chat/completions", (), body)


def replicas(n: int) -> list[ReplicaRoute]:
    return [ReplicaRoute(f"r{i}", f"atomr:d:r{i}", None) for i in range(n)]


def test_block_hashes_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    a, b = block_hashes("x" * 600 + "y" * 300, 100), block_hashes("x" * 600 + "z" * 300, 100)
    assert len(a) == len(b) == 9  # full blocks only
    assert a[:6] == b[:6] and not set(a[6:]) & set(b[6:])
    assert block_hashes("short", 100) == ()


def test_a_later_turn_extends_the_earlier_one_and_keeps_its_conversation_key() -> None:
    one, two = prompt_key(chat("where is Paris? ")), prompt_key(chat("where is Paris? ", "in France. ", "and Rome? "))
    assert one is not None and two is not None
    assert two.blocks[: len(one.blocks) - 1] == one.blocks[: len(one.blocks) - 1]
    assert one.conversation == two.conversation
    other = prompt_key(chat("what is 2+2? "))
    assert other.conversation != one.conversation and other.blocks[0] == one.blocks[0]  # the shared system prompt
    assert prompt_key({"prompt": "a plain prompt " * 40}).blocks
    assert key_of(None) is None and key_of(3) is None  # no text to match
    token_ids = RoutingFacts.of("/v1/completions", {"model": "d", "prompt": [1, 2]})
    assert token_ids.prompt is None and key_of(token_ids.prompt) is None  # token ids: no text either


def test_the_next_turn_goes_where_the_conversation_went() -> None:
    index, pool = PrefixIndex(), replicas(4)
    loads = {r.actor_name: 0 for r in pool}
    first, reason = pick_prefix_affinity(pool, loads, 8, prompt_key(chat("hello ")), index)
    assert reason == "no_affinity"
    loads[first.actor_name] += 1
    again, reason = pick_prefix_affinity(pool, loads, 8, prompt_key(chat("hello ", "hi! ", "tell me more ")), index)
    assert (again, reason) == (first, "affinity_hit")


def test_two_routers_place_a_new_conversation_on_the_same_replica() -> None:
    pool = replicas(8)
    loads = {r.actor_name: 0 for r in pool}
    for topic in ("a ", "b ", "c ", "d "):
        key = prompt_key(chat(topic))
        mine, _ = pick_prefix_affinity(pool, loads, 8, key, PrefixIndex())
        theirs, _ = pick_prefix_affinity(pool, loads, 8, key, PrefixIndex())
        assert mine is theirs


def test_a_busy_holder_overflows_to_the_least_loaded_and_the_prefix_follows() -> None:
    index, pool = PrefixIndex(), replicas(3)
    loads = {r.actor_name: 0 for r in pool}
    holder, _ = pick_prefix_affinity(pool, loads, 16, prompt_key(chat("x ")), index)
    # mean (2 + 9 + 1) / 3 = 4: the bound is max(1.25 x 4, 4 + SLACK) = 8 < 9 + 1
    loads = {r.actor_name: 1 for r in pool} | {holder.actor_name: 9}
    moved, reason = pick_prefix_affinity(pool, loads, 16, prompt_key(chat("x ", "y ", "z ")), index)
    assert reason == "overflow" and moved is not holder and loads[moved.actor_name] == 1
    loads[holder.actor_name] = 0
    follows, reason = pick_prefix_affinity(pool, loads, 16, prompt_key(chat("x ", "y ", "z ", "w ")), index)
    assert (follows, reason) == (moved, "affinity_hit")


def test_a_cache_hit_is_worth_a_few_requests_of_imbalance() -> None:
    index, pool = PrefixIndex(), replicas(2)
    loads = {r.actor_name: 0 for r in pool}
    holder, _ = pick_prefix_affinity(pool, loads, 16, prompt_key(chat("x ")), index)
    loads[holder.actor_name] = 4  # mean 2.5, bound 6.5: a hit still beats a full prefill elsewhere
    again, reason = pick_prefix_affinity(pool, loads, 16, prompt_key(chat("x ", "y ", "z ")), index)
    assert (again, reason) == (holder, "affinity_hit")


def test_a_new_conversation_takes_its_second_choice_when_the_first_is_busier() -> None:
    pool = replicas(8)
    key = prompt_key(chat("new topic "))
    first, second = rendezvous_order(key.conversation, tuple(r.actor_name for r in pool))[:2]
    loads = {r.actor_name: 2 for r in pool}
    chosen, reason = pick_prefix_affinity(pool, loads, 16, key, PrefixIndex())
    assert (chosen.actor_name, reason) == (first, "no_affinity")  # equal loads: every router agrees
    loads[first] = 3  # within the bound, but heavier than the second by more than (1.25 - 1) x the mean
    chosen, reason = pick_prefix_affinity(pool, loads, 16, key, PrefixIndex())
    assert (chosen.actor_name, reason) == (second, "no_affinity")


def test_only_listed_replicas_with_room_are_picked() -> None:
    index, pool = PrefixIndex(), replicas(2)
    key = prompt_key(chat("q "))
    first, _ = pick_prefix_affinity(pool, {}, 4, key, index)
    rest = [r for r in pool if r is not first]
    chosen, _ = pick_prefix_affinity(rest, {}, 4, key, index)  # the holder left the table
    assert chosen is rest[0]
    full = {r.actor_name: 4 for r in pool}
    assert pick_prefix_affinity(pool, full, 4, key, index) == (None, "full")


def routed(requests: list[tuple[RoutingFacts, HttpRequest]]) -> tuple[Router, list[FakeReplica]]:
    """``requests`` sent in turn through a router over four fake replicas of a prefix_affinity deployment."""
    fakes = [FakeReplica(f"r{i}") for i in range(4)]
    dep = DeploymentRoute("d", 8, "queue", tuple(route(f) for f in fakes), policy="prefix_affinity")
    table = RoutingTable(1, {"d": dep})

    async def source(version):
        return table if version != table.version else None

    async def main() -> Router:
        r = Router(source)
        for facts, request in requests:
            async for _ in r.stream(facts, request):
                pass
        await r.aclose()
        return r

    return asyncio.run(main()), fakes


def test_the_router_sends_a_conversation_back_to_its_replica() -> None:
    turns = (("hi ",), ("hi ", "hello ", "more "), ("hi ", "hello ", "more ", "ok ", "and? "))
    r, fakes = routed([(RoutingFacts("d", RequestKind.CHAT, prompt=json.loads(chat(*t).body)["messages"]), chat(*t))
                       for t in turns])
    assert sorted(f.calls for f in fakes) == [0, 0, 0, 3]  # all three turns on one replica
    assert r.route_reasons == {("d", "no_affinity"): 1, ("d", "affinity_hit"): 2}


def test_a_conversation_under_another_cache_salt_is_no_affinity_hit() -> None:
    """vLLM hashes a request's ``cache_salt`` into its first block: the same prompt under another
    salt shares nothing cached, so the router does not count it as a hit."""
    later = ("hi ", "hello ", "more ")
    bodies = [{**json.loads(chat(*turns).body), "cache_salt": salt}
              for salt, turns in (("a", ("hi ",)), ("a", later), ("b", later))]
    r, _ = routed([(RoutingFacts.of("/v1/chat/completions", body),
                    HttpRequest("POST", "/v1/chat/completions", (), json.dumps(body).encode())) for body in bodies])
    assert r.route_reasons == {("d", "no_affinity"): 2, ("d", "affinity_hit"): 1}
    salted = [key_of(json.loads(chat("hi ").body)["messages"], salt=s) for s in (None, "a", "b")]
    assert len({k.blocks[0] for k in salted}) == 3 and len({k.conversation for k in salted}) == 3


def test_a_match_on_the_shared_system_prompt_alone_does_not_pull_a_new_conversation() -> None:
    pool = replicas(8)
    loads = {r.actor_name: 0 for r in pool}
    seen = PrefixIndex()
    for topic in ("a ", "b ", "c "):  # conversations with the same system prompt went somewhere
        pick_prefix_affinity(pool, loads, 8, prompt_key(chat(topic)), seen)
    for topic in ("d ", "e ", "f ", "g "):
        key = prompt_key(chat(topic))
        assert key.shared >= 1  # its system prompt's blocks are known to `seen`
        assert pick_prefix_affinity(pool, loads, 8, key, seen)[0] is pick_prefix_affinity(
            pool, loads, 8, key, PrefixIndex()
        )[0]


def test_the_prefixes_of_a_deployment_or_adapter_gone_from_the_table_are_forgotten() -> None:
    """One index per deployment and adapter (up to 200,000 blocks, tens of MB): a router that
    kept them for every deployment and adapter it ever routed grew without end."""
    from atomr_infer.routing.picker import ReplicaPicker

    pool = replicas(2)
    loads = {r.actor_name: 0 for r in pool}
    deps = {name: DeploymentRoute(name, 8, "queue", tuple(pool), policy=policy, adapters=("a1", "a2"))
            for name, policy in (("d", "prefix_affinity"), ("e", "prefix_affinity"), ("k", "kv_events"))}
    picker = ReplicaPicker()
    picker.table_changed(RoutingTable(1, deps))
    for dep in deps.values():
        for adapter in (None, "a1", "a2"):
            messages = json.loads(chat("hi ").body)["messages"]
            picker.pick(dep, pool, loads, lambda m=messages: key_of(m), adapter)
    assert len(picker._prefixes) == 9
    picker.table_changed(RoutingTable(2, {
        "d": DeploymentRoute("d", 8, "queue", tuple(pool), policy="prefix_affinity", adapters=("a2",)),  # a1 went
        "e": DeploymentRoute("e", 8, "queue", tuple(pool), policy="power_of_two"),  # another policy
        "k": deps["k"],  # kv_events falls back to prefix affinity: kept
    }))  # and a deployment gone
    assert set(picker._prefixes) == {("d", None), ("d", "a2"), ("k", None), ("k", "a1"), ("k", "a2")}
