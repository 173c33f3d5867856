"""The usage a response reports (prompt plus completion tokens): read for the access log and
the token budgets, and asked of a stream whose client did not ask for it (then hidden again)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


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


async def without_usage(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The SSE stream without the usage-only event (``"choices": []``) the client did not ask for."""
    try:
        async for chunk in chunks:
            events = chunk.split(b"\n\n")
            kept = [e for e in events if not (e.startswith(b"data: {") and b'"usage"' in e and _usage_only(e))]
            if len(kept) != len(events):
                chunk = b"\n\n".join(kept)
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
