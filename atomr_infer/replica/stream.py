"""Per-request output streams between the step loop and the callers.

A stream holds at most one pending vLLM ``RequestOutput``: if the consumer has not taken the
last one when the next engine step delivers more, the two are merged (``RequestOutput.add``,
as vLLM's ``RequestOutputCollector`` does). So memory per request is bounded by its own output,
never by how far the consumer lags, and a caller receives at most one item per engine step.
Streams are touched only from the actor's event loop thread; the step loop hands outputs over
with one ``call_soon_threadsafe`` per engine step, not one per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any


class RequestStream:
    __slots__ = (
        "request_id",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "submitted_at",
        "first_token_at",
        "last_token_at",
        "_pending",
        "_error",
        "_closed",
        "_ready",
    )

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens vLLM's prefix cache had (its first output says)
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._pending: Any = None  # a RequestOutput (or any object with .add and .finished)
        self._error: BaseException | None = None
        self._closed = False  # the final output or an error was put
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self._closed

    def put(self, output: Any, new_tokens: int) -> None:
        """Deliver one engine step's output for this request (merged if one is pending)."""
        if self._closed:
            return
        now = time.monotonic()
        self.cached_tokens = max(self.cached_tokens, getattr(output, "num_cached_tokens", None) or 0)
        if new_tokens:
            self.completion_tokens += new_tokens
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        if self._pending is None:
            self._pending = output
        else:
            self._pending.add(output, aggregate=True)
        self._closed = bool(output.finished)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``; the consumer raises it after any pending output."""
        if self._closed:
            return
        self._error, self._closed = error, True
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            if self._pending is None and self._error is None:
                # Single-threaded (event loop only), so nothing can slip in between.
                self._ready.clear()
                await self._ready.wait()
            output, self._pending = self._pending, None
            if output is not None:
                yield output
                if output.finished:
                    return
            elif self._error is not None:
                raise self._error


def new_tokens(output: Any) -> int:
    """Tokens an engine step's output adds (DELTA: this step's; FINAL_ONLY: all)."""
    completions = getattr(output, "outputs", ())
    if not isinstance(completions, list):  # a pooling output: no generated tokens
        return 0
    return sum(len(getattr(c, "token_ids", ())) for c in completions)


def finish_reason(output: Any) -> str:
    completions = getattr(output, "outputs", ())
    first = completions[0] if isinstance(completions, list) and completions else None
    return getattr(first, "finish_reason", None) or "stop"
