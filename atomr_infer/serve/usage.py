"""The usage a response reports (prompt plus completion tokens): read for the access log and
the token budgets, and asked of a stream whose client did not ask for it (then hidden again)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from atomr_infer.errors import InvalidRequest
from atomr_infer.wire import RequestKind, RoutingFacts, as_vllm_reads

# Anthropic's usage counts the prompt in parts (Messages): all of them, with the output.
_ANTHROPIC_PARTS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
_COHERE_PARTS = ("input_tokens", "output_tokens")


def usage_tokens(data: bytes, sse: bool = False) -> int | None:
    """The tokens (prompt plus output) of the last usage in a JSON body or (``sse``) an SSE chunk,
    if there is one: OpenAI's ``usage.total_tokens`` (chat, completions, embeddings, Responses,
    where a stream's usage is in its ``response``), Anthropic's parts (Messages: a stream's last
    usage is its ``message_delta``'s), Cohere's ``usage.tokens`` (``/cohere/v2/chat``: a stream's
    is its ``message-end``'s ``delta``'s) or ``meta.billed_units`` (``/v2/embed``)."""
    at = max(data.rfind(b'"usage"'), data.rfind(b'"billed_units"'))
    if at < 0:
        return None
    if sse:  # the event's one line of JSON (its text may hold "data: " too: the line, not the last one)
        line = data[data.rfind(b"\n", 0, at) + 1 : (end if (end := data.find(b"\n", at)) >= 0 else len(data))]
        if not line.startswith(b"data: "):
            return None
        data = line[len(b"data: ") :]
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    usage = parsed.get("usage")
    for holder in ("response", "delta"):  # a Responses event's usage is its response's, Cohere's its delta's
        if not isinstance(usage, dict) and isinstance(parsed.get(holder), dict):
            usage = parsed[holder].get("usage")
    if not isinstance(usage, dict) and isinstance(meta := parsed.get("meta"), dict):  # Cohere's
        billed = meta.get("billed_units")
        if isinstance(billed, dict) and isinstance(billed.get("input_tokens"), int):
            return billed["input_tokens"] + (billed.get("image_tokens") or 0)
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    cohere = usage.get("tokens") or usage.get("billed_units")  # Cohere chat's: numbers, floats in vLLM's
    if isinstance(cohere, dict) and all(isinstance(cohere.get(n), (int, float)) for n in _COHERE_PARTS):
        return round(sum(cohere[n] for n in _COHERE_PARTS))
    parts = [usage.get(name) for name in _ANTHROPIC_PARTS]
    if not isinstance(parts[0], int) or not isinstance(parts[1], int):
        return None
    return sum(p for p in parts if isinstance(p, int))


# JSON strings of media, not text: data URLs, and long runs of base64 (an audio part's data).
_MEDIA = re.compile(rb'"data:[^"]*"|"[A-Za-z0-9+/=_-]{512,}"')


def prompt_estimate(body: bytes) -> int:
    """About the prompt tokens of a request ``body``: its bytes / 4, less its media (an image's
    data URL is megabytes, which vLLM counts as a few thousand tokens at most); 0 for a body not
    JSON (an audio form: its file is all media)."""
    if not body.lstrip().startswith(b"{"):
        return 0
    return len(_MEDIA.sub(b'""', body)) // 4


def body_tokens(body: bytes, headers: Mapping[str, str], status: int = 200) -> int | None:
    """``usage_tokens`` of an answer not streamed: a binary one (embeddings with
    ``encoding_format: bytes``) carries its usage in its ``metadata`` header. An answer that
    reports none (audio: a transcription's usage is in seconds, a translation has none) is about
    its bytes / 4, at least 1, so that a token budget is not bypassed; an error, None: nothing ran."""
    if headers.get("content-type", "").startswith("application/octet-stream"):
        tokens = usage_tokens(headers.get("metadata", "").encode())
    else:
        tokens = usage_tokens(body)
    if tokens is None and status < 400:
        return max(1, len(body) // 4)
    return tokens


def refuse_uncounted(data: Any, facts: RoutingFacts) -> None:
    """``InvalidRequest`` for a request whose answer reports no usage to charge to a token budget:
    embeddings as ``bytes_only`` (no metadata header), and a background response (answered
    ``queued`` before it runs; its usage comes only with a later retrieve, which is not charged)."""
    if not isinstance(data, dict):
        return
    if data.get("encoding_format") == "bytes_only":
        raise InvalidRequest("encoding_format", "'bytes_only' answers carry no usage to charge to a "
                             "tokens_per_minute budget: use 'bytes' (its usage is in the metadata header)")
    if facts.kind is RequestKind.RESPONSES and as_vllm_reads(data.get("background")):
        raise InvalidRequest("background", "a background response is answered before it runs, with no usage to "
                             "charge to a tokens_per_minute budget: send background: false")


async def without_usage(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The SSE stream without the usage-only event (``"choices": []``) the client did not ask for."""
    try:
        async for chunk in chunks:
            events = chunk.split(b"\n\n")
            kept = [e for e in events if not (e.startswith(b"data: {") and b'"usage"' in e and _usage_only(e))]
            if len(kept) != len(events):
                chunk = type(chunk)(b"\n\n".join(kept))  # the router's LastBytes stay the last
            if chunk:
                yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # closed early: the source too, now


def _usage_only(event: bytes) -> bool:
    try:
        data = json.loads(event[len(b"data: ") :])
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("choices") == [] and bool(data.get("usage"))
