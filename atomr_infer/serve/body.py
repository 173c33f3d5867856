"""Read and decode a request body defensively: size, UTF-8, JSON, nesting depth, NaN.

Every failure is a typed error that the ingress turns into a 4xx with an OpenAI error body,
never a 500: ``RequestTooLarge`` (413, naming the limit) or ``InvalidRequest`` on ``body``.
Python's ``json`` accepts ``NaN``/``Infinity`` and raises ``RecursionError`` on deep nesting;
both are handled here, before any model sees the data.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from atomr_infer.errors import InvalidRequest, RequestTooLarge

MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any chat request; a bound on what one request may make us buffer
MAX_JSON_DEPTH = 64  # OpenAI bodies nest 5-6 levels (tools' JSON schemas a few more)


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, refused as soon as it is known to exceed ``limit`` (header or bytes read)."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise InvalidRequest("body", f"Content-Length {content_length!r} is not a number") from None
        if declared > limit:
            raise RequestTooLarge(limit, declared)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:  # chunked uploads declare no length: count as we read
            raise RequestTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)


def _no_constants(name: str) -> Any:
    raise InvalidRequest("body", f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON: no NaN/Infinity, at most ``max_depth`` levels of nesting. In UTF-8 (with or
    without a byte-order mark), UTF-16 or UTF-32, told apart as ``json.loads`` of bytes does, as
    vLLM's routes read a body (a file saved by a Windows tool starts with a BOM)."""
    encoding = json.detect_encoding(raw)
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            "body", f"the request body is not valid {encoding.removesuffix('-sig').upper()} "
            f"(byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise InvalidRequest("body", f"the request body nests deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise InvalidRequest("body", f"the request body is not valid JSON: {exc}") from None
    depth = json_depth(data, max_depth)
    if depth > max_depth:
        raise InvalidRequest("body", f"the request body nests deeper than {max_depth} levels")
    return data


def as_utf8(raw: bytes) -> bytes:
    """A JSON body that ``parse_json`` read as UTF-16, UTF-32 or UTF-8 with a byte-order mark, as
    plain UTF-8, the same text: what the ingress adds to a body (a request id) is UTF-8."""
    encoding = json.detect_encoding(raw)
    return raw if encoding == "utf-8" else raw.decode(encoding).encode()


def json_depth(data: Any, stop_at: int) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), counted without recursion; stops past ``stop_at``."""
    deepest, level = 0, [(data, 0)]
    while level:
        value, depth = level.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > stop_at:
                return deepest
            level.extend((v, depth) for v in value if isinstance(v, (list, dict)))
    return deepest
