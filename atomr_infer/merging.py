"""One merging stream: what a slow reader has not taken yet is merged, not queued.

Every hop of the data path between the engine and the caller uses it: the replica's
per-request streams (vLLM's ``RequestOutput``s, merged as vLLM's ``RequestOutputCollector``
merges them), the replica's OpenAI app (body bytes), a channel's batch (each request's items)
and the router's per-request inbox. So memory per request is bounded by its own output, never
by how far its reader lags, and a lagging reader takes fewer, larger pieces (at most one per
engine step). A channel's batch is the exception: Ray resumes the replica's generator as soon
as it has sent an item, not when the router has read it, so a batch holds what one turn of the
replica's loop gathered (Ray's generator backpressure, a private option, was measured and not
taken: docs/performance.md). Touched from one event loop only: no locks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")
# merge(earlier, later): the two as one item (``earlier`` may be changed and returned), or
# None when they do not merge (the later one is then kept as an item of its own).
Merge = Callable[[T, T], "T | None"]


def join_bytes(earlier: object, later: object) -> object | None:
    """Body pieces join; anything else (an ``HttpHead``) stays apart."""
    if isinstance(earlier, bytes) and isinstance(later, bytes):
        return earlier + later
    return None


def put_merged(pending: list[T], item: T, merge: Merge[T]) -> None:
    """Append ``item`` to what is not taken yet, merged into the last item where they merge."""
    if pending:
        merged = merge(pending[-1], item)
        if merged is not None:
            pending[-1] = merged
            return
    pending.append(item)


class MergingBuffer(Generic[T]):
    """Items one producer puts and one reader takes, in order, merged while not taken; then an
    end (with an error, raised to the reader after the items put before it)."""

    __slots__ = ("_pending", "_merge", "_ended", "_error", "_ready")

    def __init__(self, merge: Merge[T]) -> None:
        self._pending: list[T] = []
        self._merge = merge
        self._ended = False
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self._ended

    def put(self, item: T) -> None:
        if self._ended:
            return
        put_merged(self._pending, item, self._merge)
        self._ready.set()

    def put_all(self, items: Iterable[T]) -> None:
        if self._ended:
            return
        for item in items:
            put_merged(self._pending, item, self._merge)
        self._ready.set()

    def end(self, error: BaseException | None = None) -> None:
        """No more items; the reader gets those pending, then ``error`` raised (if any)."""
        if not self._ended:
            self._ended, self._error = True, error
            self._ready.set()

    def _last(self, item: T) -> T:
        """The last item of a stream that ended cleanly, as the reader gets it (marked by a subclass)."""
        return item

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            if not self._pending and not self._ended:
                # One event loop: nothing can slip in between the check and the wait.
                self._ready.clear()
                await self._ready.wait()
            items, self._pending = self._pending, []
            if self._ended and self._error is None and items:  # nothing can be put after the end
                items[-1] = self._last(items[-1])
            for item in items:
                yield item
            if self._ended and not self._pending:
                if self._error is not None:
                    raise self._error
                return
