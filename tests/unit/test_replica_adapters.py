"""A replica's LoRA adapters across a manager restart (no Ray: the real ``VllmReplica`` over a
scripted engine, its adapter loads recorded)."""

from __future__ import annotations

import asyncio

from atomr_infer.engine.vllm.backend import VllmBackend
from atomr_infer.replica.actor import VllmReplica

from .test_replica_observability import BACKEND, no_openai_app


def test_a_replica_readopted_by_a_restarted_manager_keeps_the_adapters_it_was_given_since(monkeypatch):
    """A restarted manager calls ``ready`` on each replica it adopts: the replica went back to the
    adapters it started with (reloading removed ones, and old sources), out of routing meanwhile."""
    calls: list[tuple[str, ...]] = []

    async def load(self, name, path):
        calls.append(("load", name, path))

    async def unload(self, name):
        calls.append(("unload", name))

    monkeypatch.setattr(VllmBackend, "_openai_app", no_openai_app)
    monkeypatch.setattr(VllmBackend, "load_adapter", load)
    monkeypatch.setattr(VllmBackend, "unload_adapter", unload)
    spec = {"name": "tuned", "model": "bundled:smollm2-135m-instruct", "device": "cpu",
            "lora": {"adapters": {"pirate": "/a/pirate-v1", "robot": "/a/robot"}}}

    async def main():
        replica = VllmReplica(spec, "r0", backend=BACKEND)
        try:
            await replica.ready(60)
            await replica.health({"pirate": "/a/pirate-v2"})  # an apply since: robot removed, pirate moved
            for _ in range(50):
                await asyncio.sleep(0.01)
            before = list(calls)
            await replica.ready(60)  # the restarted manager adopts it
            await asyncio.sleep(0.1)
            return before, calls[len(before):], (await replica.health(None)).adapters
        finally:
            await replica.shutdown()

    before, after_adoption, states = asyncio.run(main())
    assert sorted(before) == [("load", "tuned:pirate", "/a/pirate-v1"), ("load", "tuned:pirate", "/a/pirate-v2"),
                              ("load", "tuned:robot", "/a/robot"), ("unload", "tuned:robot")]
    assert after_adoption == [] and states == {"pirate": "loaded"}
