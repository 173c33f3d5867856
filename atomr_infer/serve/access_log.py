"""One access-log line and the request metrics for every model request of the HTTP API.

    api_request key=alice deployment=smollm2 status=200 tokens=41 latency_ms=812.4

``key`` is the API key's name (``-`` without keys, or before one was accepted); the key itself
never appears. ``deployment`` is ``-`` for a request refused before its body was read (401); a
name no deployment has is cut to its first 128 characters (and ``…``).
``tokens`` is the usage the response reports (prompt plus completion), when it reports one:
every non-streamed answer, and a stream with ``stream_options.include_usage``. A stream the client
left before its usage is charged, and logged, an estimate: one token per event it was sent, and
its request body's bytes / 4, less its media, for the prompt; so is a stream asked for its usage
that ended without one, and an answer not streamed that reports none is its bytes / 4 (serve/usage.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from atomr_infer.log import get_logger
from atomr_infer.metrics import ApiMetrics
from atomr_infer.serve.usage import usage_tokens

log = get_logger(__name__)
NO_KEY = "-"
MAX_UNKNOWN_NAME = 128  # characters of a name no deployment has, logged: the client chose its length


class AccessLog:
    def __init__(self, known: Callable[[str], bool] = lambda deployment: True) -> None:
        self._metrics = ApiMetrics()
        # Whether a name is a deployment (or one's adapter): the metrics' label is "-" for any
        # other, as a client may send any string (one series each, for good).
        self._known = known

    def done(self, key: str | None, deployment: str, status: int, tokens: int | None, started: float) -> None:
        key = key or NO_KEY
        latency_ms = round((time.perf_counter() - started) * 1000, 1)
        known = self._known(deployment)
        # A 4 MB model name made a 4 MB log line, for anyone where the API has no keys.
        logged = deployment if known or len(deployment) <= MAX_UNKNOWN_NAME else f"{deployment[:MAX_UNKNOWN_NAME]}…"
        log.info("api_request", key=key, deployment=logged, status=status, tokens=tokens, latency_ms=latency_ms)
        self._metrics.request(key, deployment if known else NO_KEY, status, tokens)

    async def stream(
        self, chunks: AsyncIterator[bytes], key: str | None, deployment: str, status: int, started: float,
        on_end: Callable[[int | None], None] = lambda tokens: None, counts_tokens: bool = True,
        prompt: Callable[[], int] = lambda: 0, usage_asked: bool = False,
    ) -> AsyncIterator[bytes]:
        """``chunks`` passed through, logged when the stream ends (or the client leaves), and
        ``on_end`` told the tokens it used (none where it does not ``counts_tokens``: a replay);
        ``prompt``: about its prompt's tokens, for a stream the client left before its usage, or
        one ``usage_asked`` (for a token budget) that ended without it (audio's, unless its form
        asked with ``stream_include_usage``)."""
        last_usage, events, whole = b"", 0, False
        try:
            async for chunk in chunks:
                if b'"usage"' in chunk:
                    last_usage = chunk
                events += chunk.count(b"data: ")
                yield chunk
            whole = True
        finally:
            # Closed early (the client left): close the source too, now, so that the request is
            # aborted in the engine at once rather than when the generator is collected.
            await chunks.aclose()  # type: ignore[attr-defined]
            tokens = usage_tokens(last_usage, sse=True) if counts_tokens else None
            # Left before its usage, or it has none to give: about what it cost.
            if tokens is None and counts_tokens and (events and not whole or whole and usage_asked):
                tokens = max(1, events + prompt())
            on_end(tokens)
            self.done(key, deployment, status, tokens, started)
