"""The data path over channels, against a real replica actor: admission by the replica across
routers, cancellation, and a replica that dies under open streams.

The replica runs the emulated engine (atomr_infer/engine/vllm/emulated.py: vLLM's real front half and
OpenAI server over a core that steps every 10 ms), so requests take a known number of steps on
any CPU. Two ``Router``s stand for two ingress replicas or Clients: each opens its own channel.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from atomr_infer.errors import CapacityExhausted, EngineError
from atomr_infer.replica.channel import LEASE_S
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.spec import parse_deployment
from atomr_infer.wire import HttpRequest, RoutingFacts

STEP_S = 0.01
LIMIT = 2  # the replica's serving.max_concurrent
JSON = (("content-type", "application/json"),)


def completion(tokens: int) -> HttpRequest:
    body = {"model": "emu", "prompt": "count", "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    return HttpRequest("POST", "/v1/completions", JSON, json.dumps(body).encode())


def start_replica(model_dir, name: str):
    from atomr_infer.engine.vllm.emulated import emulated_backend
    from atomr_infer.replica import replica_actor_class

    spec = parse_deployment({"name": "emu", "model": str(model_dir), "device": "cpu",
                             "serving": {"max_concurrent": LIMIT}})
    actor = replica_actor_class().options(name=name, namespace="atomr", num_cpus=0).remote(
        spec.model_dump(mode="json"), name, backend=emulated_backend(str(model_dir), STEP_S)
    )
    ray.get(actor.ready.remote(300))
    return actor


@pytest.fixture(scope="module")
def emulated(ray_cluster, bundled_model_dir):
    actor = start_replica(bundled_model_dir, "atomr:emu:channels")
    yield actor
    ray.kill(actor)


def router_for(actor, name: str = "atomr:emu:channels", mode: str = "queue", migration_tries: int = 2) -> Router:
    route = ReplicaRoute("r0", name, actor)
    table = RoutingTable(1, {"emu": DeploymentRoute("emu", LIMIT, mode, (route,), migration_tries=migration_tries)})

    async def source(version):
        return table if version != table.version else None

    return Router(source)


async def completion_tokens(router: Router, tokens: int) -> int:
    """Stream one completion; its usage's completion tokens."""
    pieces = [p async for p in router.stream(RoutingFacts.of_http(completion(tokens)), completion(tokens))]
    events = [e for e in b"".join(pieces[1:]).split(b"\n\n") if e.startswith(b"data: {")]
    return json.loads(events[-1][6:])["usage"]["completion_tokens"]


async def idle(actor, timeout_s: float = 10.0):
    """The replica's stats once its engine has nothing left to run (aborts land a step later)."""
    deadline = time.monotonic() + timeout_s
    while (stats := await actor.stats.remote()).engine_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return stats


def test_max_concurrent_is_the_replicas_limit_across_two_routers(emulated):
    async def main():
        a, b = router_for(emulated), router_for(emulated)  # each counts only its own requests
        most = 0
        work = asyncio.gather(*(completion_tokens(r, 40) for r in (a, b, a, b, a, b)))
        while not work.done():
            stats = await emulated.stats.remote()
            most = max(most, stats.engine_unfinished)
            await asyncio.sleep(0.02)
        return await work, most

    counts, most = asyncio.run(main())
    assert counts == [40] * 6  # every request served, queued for a slot when the replica was full
    assert 1 <= most <= LIMIT  # never more than the replica's limit running, though each router sent 3


def test_a_router_that_sent_nothing_yet_rejects_when_the_replica_is_full(emulated):
    async def main():
        holder, late = router_for(emulated), router_for(emulated, mode="reject")
        held = [asyncio.ensure_future(completion_tokens(holder, 300)) for _ in range(LIMIT)]
        while (await emulated.stats.remote()).engine_unfinished < LIMIT:
            await asyncio.sleep(0.02)
        with pytest.raises(CapacityExhausted):
            await completion_tokens(late, 5)  # its own count is 0; the replica says it is full
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await idle(emulated)  # the cancelled ones were aborted

    asyncio.run(main())


def test_leaving_a_stream_aborts_the_request_in_the_engine(emulated):
    async def main():
        before = await idle(emulated)
        items = router_for(emulated).stream(RoutingFacts.of_http(completion(1500)), completion(1500))
        head = await anext(items)
        assert head.status == 200
        await anext(items)  # the first tokens arrived
        assert (await emulated.stats.remote()).engine_unfinished == 1
        await items.aclose()  # the consumer leaves
        return before, await idle(emulated)

    before, after = asyncio.run(main())
    assert after.engine_unfinished == 0 and after.in_flight == 0
    assert after.requests_aborted == before.requests_aborted + 1


def test_a_replica_that_dies_fails_its_open_streams(ray_cluster, bundled_model_dir):
    """With serving.migration off (on, the streams would wait for another replica to move to:
    tests/e2e/test_migration.py)."""
    actor = start_replica(bundled_model_dir, "atomr:emu:doomed")

    async def main():
        router = router_for(actor, name="atomr:emu:doomed", migration_tries=0)
        streams = [router.stream(RoutingFacts.of_http(completion(1500)), completion(1500)) for _ in range(2)]
        for items in streams:
            await anext(items)  # head
            await anext(items)  # tokens are flowing
        ray.kill(actor)
        killed = time.monotonic()
        for items in streams:
            with pytest.raises(EngineError, match="died mid-request"):
                async for _ in items:
                    pass
        return time.monotonic() - killed

    waited = asyncio.run(main())
    assert waited < 30  # a liveness bound, not a speed target: it must not hang


def test_the_requests_of_a_router_that_died_are_cancelled(emulated):
    """Ray does not stop a streaming call whose caller died: the channel's lease does."""
    repo = Path(__file__).resolve().parents[2]
    script = Path(__file__).with_name("router_process.py")
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    gcs = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, str(script), gcs, "atomr:emu:channels"], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "STREAMING"
        before = ray.get(emulated.stats.remote())
        assert before.engine_unfinished == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Left alone it would run its 2,000 tokens (20 s) to the end ("length", not aborted); the lease
    # cancels it LEASE_S after the router's last word (+ the watchdog's 1 s period).
    after = asyncio.run(idle(emulated, timeout_s=LEASE_S + 10))
    assert after.engine_unfinished == 0
    assert after.requests_aborted == before.requests_aborted + 1


def test_a_whole_answer_is_said_prefilled_at_its_first_token_not_at_its_end(emulated):
    """kv_events: a completion not streamed (vLLM's FINAL_ONLY: no output before its last) counts
    as prefill waiting on the replica only until the engine computed its prompt. The step loop
    reads that from vLLM's output processor (engine/vllm/prefill_watch.py) and the replica tells
    the router in a batch, with the replica's count, while the answer is still being generated."""
    from atomr_infer.routing.channel import ReplicaChannel
    from atomr_infer.wire import OpenRequest

    body = {"model": "emu", "prompt": "count", "max_tokens": 300}  # 300 steps of 10 ms: 3 s at least
    whole = HttpRequest("POST", "/v1/completions", JSON, json.dumps(body).encode())

    async def main():
        channel, told = ReplicaChannel(emulated), asyncio.Event()
        answer = asyncio.ensure_future(_pieces(channel.request(OpenRequest("", whole, prefill_blocks=4), None,
                                                               told.set)))
        await asyncio.wait_for(told.wait(), 30)
        said, running = channel.prefill, not answer.done()
        pieces = await answer
        await asyncio.gather(*channel.close(), return_exceptions=True)
        return said, running, pieces

    said, running, pieces = asyncio.run(main())
    assert running  # told while the answer was still being generated
    assert said == 0  # and the replica no longer counts its prefill
    assert json.loads(b"".join(pieces[1:]))["usage"]["completion_tokens"] == 300


async def _pieces(items):
    return [item async for item in items]
