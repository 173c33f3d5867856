"""Router chunks as OpenAI response bodies: whole (non-streaming) or as SSE events.

Each router ``Chunk`` (one engine step's output for one request) becomes exactly one SSE
event, written as soon as it arrives; nothing waits for a timer. With
``stream_options.include_usage`` a last event with empty ``choices`` carries the usage. A
failure after the stream started becomes one SSE error event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.replica.request import Chunk, Usage
from atomr_infer.serve.errors import http_error

log = get_logger(__name__)
DONE = b"data: [DONE]\n\n"


def _usage(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class _Format:
    """The id, model and timestamp one response shares across its chunks."""

    object_full = object_chunk = ""

    def __init__(self, response_id: str, model: str, include_usage: bool = False) -> None:
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.include_usage = include_usage
        self._first = True

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
        body = self._envelope(self.object_full, [self._full_choice(text, finish_reason)])
        body["usage"] = _usage(usage)
        return body

    def event(self, chunk: Chunk) -> bytes:
        body = self._envelope(self.object_chunk, [self._chunk_choice(chunk)])
        if self.include_usage:
            body["usage"] = None
        self._first = False
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def usage_event(self, usage: Usage | None) -> bytes:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = _usage(usage)
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, chunk: Chunk) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(_Format):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def _chunk_choice(self, chunk: Chunk) -> dict[str, Any]:
        delta = {"role": "assistant", "content": chunk.text_delta} if self._first else {"content": chunk.text_delta}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": chunk.finish_reason}


class CompletionFormat(_Format):
    object_full = object_chunk = "text_completion"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _chunk_choice(self, chunk: Chunk) -> dict[str, Any]:
        return {"index": 0, "text": chunk.text_delta, "logprobs": None, "finish_reason": chunk.finish_reason}


async def collect(chunks: AsyncIterator[Chunk], fmt: _Format) -> dict[str, Any]:
    """Drain ``chunks`` into one non-streaming response body."""
    parts: list[str] = []
    finish: str | None = None
    usage: Usage | None = None
    async for chunk in chunks:
        parts.append(chunk.text_delta)
        finish = chunk.finish_reason or finish
        usage = chunk.usage or usage
    return fmt.full("".join(parts), finish, usage)


async def sse_events(chunks: AsyncIterator[Chunk], first: Chunk | None, fmt: _Format) -> AsyncIterator[bytes]:
    """SSE events for ``first`` and the rest of ``chunks``, then ``[DONE]`` (also after an error).

    Cancellation (the client went away) is not caught: it closes ``chunks``, which aborts the
    request in the engine.
    """
    usage = first.usage if first is not None else None
    try:
        if first is not None:
            yield fmt.event(first)
        async for chunk in chunks:
            if chunk.text_delta or chunk.token_ids or chunk.finish_reason:
                yield fmt.event(chunk)
            usage = chunk.usage or usage
        if fmt.include_usage:
            yield fmt.usage_event(usage)
    except Exception as exc:  # noqa: BLE001 - after the 200 the only way to report is in-band
        log.warning("stream_failed", response_id=fmt.id, error=repr(exc))
        yield http_error(exc).sse()
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    yield DONE
