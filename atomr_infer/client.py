"""``Client``: call deployments by name from Python, routed straight to replicas.

    client = atomr_infer.Client()
    print(client.chat("smollm2", [{"role": "user", "content": "Hi"}]).text)
    for chunk in client.stream_chat("smollm2", messages):
        print(chunk.text_delta, end="", flush=True)

The client holds its own ``Router`` (cached routing table, power-of-two choices), so requests
go from this process to a replica without passing through the manager. The async methods
(``acomplete``, ``achat``, ``astream_chat``) run on the caller's event loop; the sync ones
run on a private loop thread. Leaving a stream early (``break``, an exception, Ctrl-C)
aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from atomr_infer.replica.request import Chunk, Usage
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import RoutingTable


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str | None
    usage: Usage | None


class Client:
    def __init__(self, address: str | None = None, manager: Any = None, wait_for_replica_s: float = 30.0) -> None:
        from atomr_infer.cluster import manager as get_manager

        self._manager = manager if manager is not None else get_manager(address)
        self._wait_s = wait_for_replica_s
        self._routers: dict[int, Router] = {}  # one per event loop: asyncio objects are loop-bound
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    async def _fetch(self, since_version: int) -> RoutingTable | None:
        return await self._manager.routing_table.remote(since_version)

    def _router(self) -> Router:
        key = id(asyncio.get_running_loop())
        router = self._routers.get(key)
        if router is None:
            router = self._routers[key] = Router(self._fetch, wait_for_replica_s=self._wait_s)
        return router

    # -- async -------------------------------------------------------------------------------

    async def astream(self, name: str, request: dict[str, Any]) -> AsyncIterator[Chunk]:
        """Chunks of one request (a ``GenerateRequest`` as a dict)."""
        async for chunk in self._router().stream(name, request):
            yield chunk

    async def astream_chat(self, name: str, messages: list[dict[str, str]], **sampling: Any) -> AsyncIterator[Chunk]:
        async for chunk in self.astream(name, {"messages": messages, **sampling}):
            yield chunk

    async def achat(self, name: str, messages: list[dict[str, str]], **sampling: Any) -> Completion:
        return await _collect(self.astream(name, {"messages": messages, **sampling}))

    async def acomplete(self, name: str, prompt: str, **sampling: Any) -> Completion:
        return await _collect(self.astream(name, {"prompt": prompt, **sampling}))

    # -- sync --------------------------------------------------------------------------------

    def _run(self, coro: Any) -> Future[Any]:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="atomr-client", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def complete(self, name: str, prompt: str, **sampling: Any) -> Completion:
        return self._run(self.acomplete(name, prompt, **sampling)).result()

    def chat(self, name: str, messages: list[dict[str, str]], **sampling: Any) -> Completion:
        return self._run(self.achat(name, messages, **sampling)).result()

    def stream(self, name: str, request: dict[str, Any]) -> Iterator[Chunk]:
        agen = self.astream(name, request)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__()).result()
                except StopAsyncIteration:
                    return
        finally:
            # Runs on break, errors and KeyboardInterrupt: closing the async generator makes
            # the router cancel the replica's generator, which aborts the engine request.
            self._run(agen.aclose()).result(timeout=10)

    def stream_chat(self, name: str, messages: list[dict[str, str]], **sampling: Any) -> Iterator[Chunk]:
        return self.stream(name, {"messages": messages, **sampling})

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


async def _collect(chunks: AsyncIterator[Chunk]) -> Completion:
    parts: list[str] = []
    last: Chunk | None = None
    async for chunk in chunks:
        parts.append(chunk.text_delta)
        last = chunk
    return Completion("".join(parts), last.finish_reason if last else None, last.usage if last else None)
