"""A ``Client`` and its manager (routing/manager_link.py, no Ray): a manager recovering after a
restart, one killed and made again, one gone; a close while a request waits; a dropped Client
collected in a fresh process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atomr_infer.client import Client
from atomr_infer.errors import DeploymentNotFound, RouterClosed, RoutingError
from atomr_infer.routing import manager_link

from .fakes import FakeManager
from .test_client_lifecycle import MESSAGES, ChatReplica
from .test_router_refresh import SlowSource

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(manager_link, "RECOVERY_POLL_S", 0.05)


def test_a_client_made_while_a_restarted_manager_recovers_waits_for_its_table():
    """The manager answers None while it re-adopts its replicas: taken as an empty table, every
    deployment was "not found" to a new Client (and to `atomr chat`)."""
    source, asks = SlowSource(ChatReplica(), delay_s=0.0), []

    async def recovering(version):
        asks.append(version)
        return None if len(asks) < 4 else await source(version)

    async def main():
        client = Client(manager=FakeManager(recovering), wait_for_replica_s=5)
        return (await client.achat("d", MESSAGES)).choices[0].message.content

    assert asyncio.run(main()) == "hi" and len(asks) >= 4


def test_a_manager_that_stays_recovering_is_a_routing_error_saying_so():
    async def main():
        client = Client(manager=FakeManager(lambda version: asyncio.sleep(0, None)), wait_for_replica_s=0.2)
        with pytest.raises(RoutingError, match="still recovering") as info:
            await client.achat("d", MESSAGES)
        return info.value

    assert not isinstance(asyncio.run(main()), DeploymentNotFound)


def test_a_manager_killed_and_made_again_is_looked_up_again(monkeypatch):
    """The Client kept the dead handle: every new deployment was "not found" for good."""

    class Dead:
        class routing_table:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote(*args):
                raise RuntimeError("ActorDiedError: The actor died because its owner has died")

    made_again = FakeManager(SlowSource(ChatReplica(), delay_s=0.0))
    lookups = []
    monkeypatch.setattr(manager_link, "lookup_manager", lambda: lookups.append(1) or made_again)

    async def main():
        client = Client(manager=Dead(), wait_for_replica_s=1)
        client._link._lookup = manager_link.lookup_manager
        with pytest.raises(RoutingError, match="the atomr manager is unavailable: .*actor died"):
            await client.achat("d", MESSAGES)  # a Ray error is atomr's own
        return (await client.achat("d", MESSAGES)).choices[0].message.content

    assert asyncio.run(main()) == "hi" and lookups == [1]


def test_close_ends_a_request_waiting_for_a_replica_at_once():
    async def main():
        client = Client(manager=FakeManager(SlowSource(None, delay_s=0.0)), wait_for_replica_s=30)
        waiting = asyncio.ensure_future(client.achat("d", MESSAGES))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await client.aclose()
        with pytest.raises(RouterClosed):
            await asyncio.wait_for(waiting, 5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 2  # it waited out wait_for_replica_s (30 s)


def test_a_dropped_client_is_collected_in_a_fresh_process():
    """The first Client to send in a process was never collected (its thread and channels lived
    on): vLLM's first import kept the importing frames in a module global, and a router held the
    Client's own bound method in a cycle the frozen heap never walks."""
    probe = """
import gc, threading, time, weakref
from atomr_infer.client import Client
from tests.unit.fakes import FakeManager
from tests.unit.test_client_lifecycle import MESSAGES, ChatReplica
from tests.unit.test_router_refresh import SlowSource
client = Client(manager=FakeManager(SlowSource(ChatReplica(), delay_s=0.0)))
assert client.chat("d", MESSAGES).choices[0].message.content == "hi"
ref = weakref.ref(client)
del client
gc.collect()
deadline = time.monotonic() + 5
while [t for t in threading.enumerate() if t.name == "atomr-client"] and time.monotonic() < deadline:
    time.sleep(0.05)
print("collected", ref() is None, [t.name for t in threading.enumerate() if t.name == "atomr-client"])
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "collected True []" in done.stdout, done.stdout + done.stderr[-2000:]


def test_an_async_client_dropped_on_a_loop_that_runs_on_closes_its_channels():
    """A notebook re-running `client = Client(); await client.achat(...)` left each dropped
    Client's channel tasks (and the replicas' leases) running for good."""
    import gc

    async def main():
        client = Client(manager=FakeManager(SlowSource(ChatReplica(), delay_s=0.0)))
        assert (await client.achat("d", MESSAGES)).choices[0].message.content == "hi"
        assert channel_tasks()
        del client
        gc.collect()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not channel_tasks():
                return []
        return channel_tasks()

    def channel_tasks() -> list[str]:
        return [repr(t.get_coro()) for t in asyncio.all_tasks() if "ReplicaChannel" in repr(t.get_coro())]

    assert asyncio.run(main()) == []
