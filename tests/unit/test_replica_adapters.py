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


def test_a_new_retry_count_has_the_replica_try_its_failed_adapters_at_once(monkeypatch):
    """An unchanged apply asks it (control/reconcile.py retry_adapters): the replica had waited out
    its backoff (10 s, doubling up to 5 min) though the adapter's files were fixed."""
    fixed, loads = [], []

    async def load(self, name, path):
        loads.append(name)
        if not fixed:
            raise OSError(f"no adapter_config.json in {path}")

    monkeypatch.setattr(VllmBackend, "_openai_app", no_openai_app)
    monkeypatch.setattr(VllmBackend, "load_adapter", load)
    spec = {"name": "tuned", "model": "bundled:smollm2-135m-instruct", "device": "cpu",
            "lora": {"adapters": {"robot": "/a/robot"}}}
    wanted = spec["lora"]["adapters"]

    async def main():
        replica = VllmReplica(spec, "r0", backend=BACKEND)
        try:
            await replica.ready(60)
            seen = [(await replica.health(wanted)).adapters]  # failed at start: backing off
            fixed.append(True)
            seen.append((await replica.health(wanted, 1)).adapters)
            await asyncio.sleep(0.1)
            seen.append((await replica.health(wanted, 1)).adapters)  # the same count: nothing more to retry
            return seen
        finally:
            await replica.shutdown()

    seen = asyncio.run(main())
    assert seen == [{"robot": "failed: no adapter_config.json in /a/robot"}, {"robot": "loading"},
                    {"robot": "loaded"}]
    assert loads == ["tuned:robot", "tuned:robot"]
