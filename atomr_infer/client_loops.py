"""The event loops a ``Client`` runs on: its private one (the sync API's thread) and its callers'
(the async API's); what ends the work on each, from any thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def close_stream(agen: AsyncIterator[Any], step: list[asyncio.Task[Any] | None]) -> None:
    waiting = step[0]  # read on the loop: a step submitted just before the interrupt has started
    if waiting is not None and not waiting.done():
        waiting.cancel()
        with contextlib.suppress(BaseException):  # its cancellation, or the chunk it had just got
            await waiting
    await agen.aclose()  # type: ignore[attr-defined]


async def cancel_all() -> None:
    """Cancel every other task of the running loop (a Client's private one) and wait for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def stop_soon(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what runs on ``loop``, then stop it (its thread ends); called from any thread."""

    async def stop() -> None:
        await cancel_all()
        loop.stop()

    if loop.is_running():
        asyncio.run_coroutine_threadsafe(stop(), loop)


def close_router_soon(loop: asyncio.AbstractEventLoop, router: Any) -> None:
    """Close ``router`` (its channels to the replicas) on ``loop``, from any thread: a Client
    dropped on a loop that runs on (a notebook's, a web server's) left its channels' tasks, and
    the replicas' leases, running for good."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(lambda: loop.create_task(router.aclose()))


async def each_within(items: AsyncIterator[Any], timeout: float, what: str) -> AsyncIterator[Any]:
    """``items``, each within ``timeout`` seconds of the last (a stream's ``timeout``, as openai's
    read timeout): ``TimeoutError`` otherwise, which cancels the wait (the request is aborted)."""
    while True:
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                item = await anext(items)  # type: ignore[call-overload]
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not scope.expired():  # the request's own TimeoutError, not this limit
                raise
            raise TimeoutError(f"{what}: nothing came within timeout={timeout:g}s") from None
        yield item
