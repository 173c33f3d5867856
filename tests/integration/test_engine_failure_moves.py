"""An engine that fails under open requests while its replica actor lives on (a crashed GPU core,
a CUDA error): the replica closes its channels before its streams fail, so routers move what they
can to another replica, as they do when a replica dies, instead of relaying the engine's error.

The failing replica runs ``broken_engine`` (the emulated engine under vLLM's real serving layer,
its core raising after some steps); the other, the plain emulated engine.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import ray

from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.spec import parse_deployment
from atomr_infer.wire import HttpRequest, RoutingFacts

pytestmark = pytest.mark.integration
STEP_S = 0.01
TOKENS = 120
JSON = (("content-type", "application/json"),)


def completion(stream: bool) -> HttpRequest:
    body = {"model": "fails", "prompt": "count", "max_tokens": TOKENS, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return HttpRequest("POST", "/v1/completions", JSON, json.dumps(body).encode())


def start_replica(model_dir, name: str, backend):
    from atomr_infer.replica import replica_actor_class

    spec = parse_deployment({"name": "fails", "model": str(model_dir), "device": "cpu"})
    actor = replica_actor_class().options(name=name, namespace="atomr", num_cpus=0).remote(
        spec.model_dump(mode="json"), name, backend=backend
    )
    ray.get(actor.ready.remote(300))
    return actor


def test_requests_on_an_engine_that_fails_finish_on_another_replica(ray_cluster, bundled_model_dir):
    import cloudpickle

    from atomr_infer.engine.vllm.backend import VllmBackend
    from atomr_infer.engine.vllm.emulated import emulated_backend
    from tests.integration import broken_engine

    cloudpickle.register_pickle_by_value(broken_engine)
    failing = start_replica(bundled_model_dir, "atomr:fails:r0", VllmBackend.factory(
        broken_engine.broken_engine_factory(str(bundled_model_dir), fail_after_steps=40)))
    healthy = start_replica(bundled_model_dir, "atomr:fails:r1", emulated_backend(str(bundled_model_dir), STEP_S))
    routes = [ReplicaRoute("r0", "atomr:fails:r0", failing), ReplicaRoute("r1", "atomr:fails:r1", healthy)]
    tables = [RoutingTable(1, {"fails": DeploymentRoute("fails", 32, "queue", (routes[0],), migration_tries=2)})]

    async def source(version):
        return tables[-1] if version != tables[-1].version else None

    async def answer(router: Router, stream: bool) -> dict:
        request = completion(stream)
        items = router.stream(RoutingFacts.of_http(request), request)
        head = await anext(items)
        body = b"".join([chunk async for chunk in items])
        if not stream:
            return {"status": head.status, **json.loads(body)}
        events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        return {"status": head.status, "text": "".join(c["text"] for e in events for c in e.get("choices", ())),
                "errors": [e for e in events if "error" in e], "usage": events[-1].get("usage"),
                "finish": [c["finish_reason"] for e in events for c in e.get("choices", ()) if c["finish_reason"]]}

    async def main():
        router = Router(source)
        # Every request starts on the replica whose engine will fail; the other joins the table after.
        work = [asyncio.ensure_future(answer(router, stream)) for stream in (True, True, True, False, False)]
        while (await failing.stats.remote()).engine_unfinished < len(work):
            await asyncio.sleep(0.02)
        tables.append(RoutingTable(2, {"fails": DeploymentRoute("fails", 32, "queue", tuple(routes),
                                                                migration_tries=2)}))
        results = await asyncio.wait_for(asyncio.gather(*work), 120)
        await router.aclose()
        return results, dict(router.migrations)

    try:
        results, migrations = asyncio.run(main())
        for result in results:
            assert result["status"] == 200, result
            if "text" in result:  # streamed
                assert not result["errors"], result["errors"]
                assert result["finish"] == ["length"], result
                assert result["usage"]["completion_tokens"] == TOKENS, result["usage"]
            else:  # whole answers: re-run from the start on the other replica
                assert result["choices"][0]["finish_reason"] == "length", result
                assert result["usage"]["completion_tokens"] == TOKENS, result["usage"]
        assert sum(migrations.values()) == 3, migrations  # the three streams moved, each once
    finally:
        ray.kill(failing)
        ray.kill(healthy)
