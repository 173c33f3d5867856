"""The usage a response reports (prompt plus completion tokens): read for the access log and
the token budgets, and asked of a stream whose client did not ask for it (then hidden again)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

# Anthropic's usage counts the prompt in parts (Messages): all of them, with the output.
_ANTHROPIC_PARTS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def usage_tokens(data: bytes) -> int | None:
    """The tokens (prompt plus output) of the last usage in a JSON body or an SSE chunk, if there
    is one: OpenAI's ``usage.total_tokens`` (chat, completions, embeddings, Responses, where a
    stream's usage is in its ``response``), or Anthropic's parts (Messages: a stream's last
    usage is its ``message_delta``'s)."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    start = data.rfind(b"data: ", 0, at)
    if start >= 0:  # an SSE event: its one line of JSON
        end = data.find(b"\n", at)
        data = data[start + len(b"data: ") : end if end >= 0 else len(data)]
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    usage = parsed.get("usage")
    if not isinstance(usage, dict):  # a Responses event's usage is its response's
        usage = (parsed.get("response") or {}).get("usage") if isinstance(parsed.get("response"), dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get(name) for name in _ANTHROPIC_PARTS]
    if not isinstance(parts[0], int) or not isinstance(parts[1], int):
        return None
    return sum(p for p in parts if isinstance(p, int))


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
