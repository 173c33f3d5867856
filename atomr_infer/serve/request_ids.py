"""``X-Request-Id`` on every answer, as ``vllm serve --enable-request-id-headers`` adds it.

vLLM's ``XRequestIdMiddleware`` (``vllm/entrypoints/serve/middleware/x_request_id.py``, 0.32)
appends to each HTTP response's headers the request's own ``X-Request-Id`` (its first, as sent,
even empty) or else a fresh ``uuid.uuid4().hex``; it changes no request, so the replica's vLLM
sees the caller's header or none, as it would behind ``vllm serve``. The ingress wraps its whole
app with the same (outside CORS, as vLLM adds it after CORS): the replicas' answers, streamed or
not, and the ingress's own errors (401, 403, 404, 413, 429, 503, a preflight) carry it. Off by
default, as on ``vllm serve``; ``atomr serve --enable-request-id-headers`` turns it on.
"""

from __future__ import annotations

import uuid
from typing import Any

HEADER = b"x-request-id"


def with_request_ids(app: Any, enabled: bool = True) -> Any:
    """``app`` (ASGI) whose every HTTP response carries ``X-Request-Id``; ``app`` itself unless ``enabled``."""
    if not enabled:
        return app

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # vLLM's matches a websocket too, but then sees no http.response.start
            await app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == HEADER), None)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                value = given if given is not None else uuid.uuid4().hex.encode()
                # a new list: a Starlette response's own raw_headers stay as they were
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, value)]}
            await send(message)

        await app(scope, receive, send_with_id)

    return wrapped
