"""One access-log line and the request metrics for every model request of the HTTP API.

    api_request key=alice deployment=smollm2 status=200 tokens=41 latency_ms=812.4

``key`` is the API key's name (``-`` without keys, or before one was accepted); the key itself
never appears. ``deployment`` is ``-`` for a request refused before its body was read (401).
``tokens`` is the usage the response reports (prompt plus completion), when it reports one:
every non-streamed answer, and a stream with ``stream_options.include_usage``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from atomr_infer.log import get_logger
from atomr_infer.metrics import ApiMetrics

log = get_logger(__name__)
NO_KEY = "-"


def usage_tokens(data: bytes) -> int | None:
    """``usage.total_tokens`` of the last usage in a JSON body or an SSE chunk, if there is one."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    start = data.rfind(b"data: ", 0, at)
    if start >= 0:  # an SSE event: its one line of JSON
        end = data.find(b"\n", at)
        data = data[start + len(b"data: ") : end if end >= 0 else len(data)]
    try:
        usage = json.loads(data).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    total = usage.get("total_tokens")
    return total if isinstance(total, int) else None


class AccessLog:
    def __init__(self) -> None:
        self._metrics = ApiMetrics()

    def done(self, key: str | None, deployment: str, status: int, tokens: int | None, started: float) -> None:
        key = key or NO_KEY
        latency_ms = round((time.perf_counter() - started) * 1000, 1)
        log.info("api_request", key=key, deployment=deployment, status=status, tokens=tokens, latency_ms=latency_ms)
        self._metrics.request(key, deployment, status, tokens)

    async def stream(
        self, chunks: AsyncIterator[bytes], key: str | None, deployment: str, status: int, started: float
    ) -> AsyncIterator[bytes]:
        """``chunks`` passed through, logged when the stream ends (or the client leaves)."""
        last_usage = b""
        try:
            async for chunk in chunks:
                if b'"usage"' in chunk:
                    last_usage = chunk
                yield chunk
        finally:
            self.done(key, deployment, status, usage_tokens(last_usage), started)
