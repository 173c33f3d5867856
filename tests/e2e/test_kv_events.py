"""``routing.policy: kv_events`` on two real replicas of the bundled model: each publishes vLLM's
KV-cache events on ports of its own on the node's (loopback) address; switching the policy is a
change in place; a router's index learns from the events exactly the blocks of the prompt it
hashes itself (so its chat template and tokenizer give the engine's tokens); the same prompt
then goes to its holder (``kv_hit``); a listener that starts late rebuilds from vLLM's replay
endpoint; a cache reset empties the index."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from tests.conftest import smollm2_spec

pytestmark = pytest.mark.e2e
NAME = "cached"
DOCUMENT = " ".join(f"Line {i}: the harbour master logs ship number {i} at dawn." for i in range(40))
ASK = [{"role": "system", "content": "You answer in one word."},
       {"role": "user", "content": DOCUMENT + "\nWhich ship came first?"}]


@pytest.fixture(scope="module")
def cached(manager, ray_cluster) -> Iterator[str]:
    ray_cluster.get(manager.apply.remote(smollm2_spec(name=NAME, replicas=2)))
    status = ray_cluster.get(manager.wait_ready.remote(NAME, 600))
    assert status is not None and status.replicas_ready == 2, status
    result = ray_cluster.get(manager.apply.remote(smollm2_spec(name=NAME, replicas=2,
                                                               routing={"policy": "kv_events"})))
    assert [a.split(" (")[0] for a in result.actions] == ["update in place"], result.actions
    yield NAME
    ray_cluster.get(manager.remove.remote(NAME))


def table_route(manager, ray_cluster):
    return ray_cluster.get(manager.routing_table.remote(-1)).deployments[NAME]


async def chat(router, ask: str | None = None) -> str:
    from atomr_infer.wire import HttpRequest, RoutingFacts

    messages = ASK if ask is None else [{"role": "user", "content": ask}]
    data = {"model": NAME, "messages": messages, "max_tokens": 1, "temperature": 0}
    body = json.dumps(data).encode()
    items = router.stream(RoutingFacts.of("/v1/chat/completions", data),
                          HttpRequest("POST", "/v1/chat/completions", (("content-type", "application/json"),), body))
    head = await anext(items)
    text = b"".join([piece async for piece in items])
    assert head.status == 200, text
    return text.decode()


async def wait_for(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_each_replica_publishes_on_its_own_port_on_the_node_address(cached, manager, ray_cluster):
    sources = [r.kv_events for r in table_route(manager, ray_cluster).replicas]
    assert all(s is not None for s in sources), sources
    endpoints = [e for endpoint, replay, _ in sources for e in (endpoint, replay)]
    nodes = {n["NodeManagerAddress"] for n in ray_cluster.nodes() if n["Alive"]}  # the test cluster's one node
    assert len(nodes) == 1 and all(e.startswith(f"tcp://{next(iter(nodes))}:") for e in endpoints), (nodes, endpoints)
    assert len(set(endpoints)) == 4  # no two sockets share a port
    assert {block for _, _, block in sources} == {128}  # vLLM's CPU block size


def test_the_index_holds_the_prompts_blocks_and_the_prompt_returns_to_its_holder(cached, manager, ray_cluster):
    from atomr_infer.routing.kv_index import chain
    from atomr_infer.routing.kv_subscriber import KvEventsHub, hub
    from atomr_infer.routing.prompt_tokens import tokenizers
    from atomr_infer.routing.router import Router

    route = table_route(manager, ray_cluster)

    async def fetch(version):
        return await manager.routing_table.remote(version)

    async def main():
        router = Router(fetch, refresh_s=0.5)
        try:
            await chat(router)  # the first: the tokenizer is fetched meanwhile (prefix affinity)
            first = route.replicas[0]
            assert first.model == route.model == smollm2_spec().model  # whose tokenizer routers use
            await wait_for(lambda: tokenizers().get(NAME, first.actor, first.model) is not None)
            tokens = tokenizers().get(NAME, first.actor, first.model).tokens(ASK)
            blocks = chain(tokens, 128)
            assert len(blocks) >= 3, len(tokens)
            index = hub().index(NAME)
            await wait_for(lambda: max(index.depths(blocks).values(), default=0) == len(blocks))
            depths = index.depths(blocks)
            holder = max(depths, key=depths.get)
            for _ in range(4):
                await chat(router)
            reasons = dict(router.route_reasons)
            assert reasons.get((NAME, "kv_hit")) == 4, reasons
            assert index.depths(blocks).get(holder) == len(blocks)

            late = KvEventsHub()  # a router that starts now: vLLM's replay endpoint rebuilds it
            late.follow(NAME, {r.actor_name: r.kv_events[:2] for r in route.replicas})
            await wait_for(lambda: late.index(NAME).depths(blocks).get(holder) == len(blocks))
            late.follow(NAME, {})

            # A router that missed the prompt's events (here: no replay at all): vLLM publishes
            # only the blocks a step computes, so it learned nothing while the prompt stayed
            # cached. A few requests a second are reported in full (kv_events.FullReports).
            blind = KvEventsHub()
            blind.follow(NAME, {r.actor_name: (r.kv_events[0], None) for r in route.replicas})
            for _ in range(10):  # (a SUB misses what is published before it has joined)
                await asyncio.sleep(1.1)  # a new second: the next request is reported in full
                await chat(router)
                if blind.index(NAME).depths(blocks).get(holder) == len(blocks):
                    break
            assert blind.index(NAME).depths(blocks).get(holder) == len(blocks), blind.index(NAME).depths(blocks)
            blind.follow(NAME, {})

            from atomr_infer.control.client import ControlPlane

            # A reset is published (AllBlocksCleared) with the engine's next step: other prompts
            # until one ran on the holder.
            await asyncio.to_thread(ControlPlane(manager).reset_prefix_cache, NAME)
            for i in range(12):
                await chat(router, f"Say {i}.")
                if holder not in index.depths(blocks):
                    break
                await asyncio.sleep(0.5)
            assert index.depths(blocks) == {}
            return reasons
        finally:
            await router.aclose()

    reasons = asyncio.run(main())
    print("kv_events route reasons:", reasons)
