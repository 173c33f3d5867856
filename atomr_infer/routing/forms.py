"""A form's field given a new value in place, every other byte of the body as it was.

A LoRA adapter's audio request (a ``multipart/form-data`` form, or an urlencoded one) names its
adapter in the form's ``model`` field, which the replica's vLLM must read as the adapter's full
name. The form is read by the parser vLLM's server reads it with (Starlette's, over
python-multipart), fed the whole body at once so that every value it reports is a span of the
body itself: only the spans of that field's values are replaced. The boundary, the file's bytes
and every other part stay as they came.
"""

from __future__ import annotations

import codecs
from typing import Any

MULTIPART = "multipart/form-data"
URLENCODED = "application/x-www-form-urlencoded"


def is_form(content_type: str) -> bool:
    return content_type.lower().startswith((MULTIPART, URLENCODED))


def with_field(body: bytes, content_type: str, name: str, value: str) -> bytes | None:
    """``body`` with each value of the field ``name`` replaced by ``value``; None when it cannot be
    done exactly: not a form, no such field with a value, or a body the parser does not read whole."""
    from python_multipart.multipart import parse_options_header

    kind, params = parse_options_header(content_type)
    try:
        if kind == MULTIPART.encode():
            charset = _charset(params.get(b"charset", b"utf-8"))
            spans = _multipart_spans(body, params.get(b"boundary", b""), name.encode(charset))
            new = value.encode(charset)
        elif kind == URLENCODED.encode():
            from urllib.parse import quote_plus

            spans, new = _urlencoded_spans(body, name), quote_plus(value).encode()
        else:
            return None
    except Exception:  # noqa: BLE001 - python-multipart's parse errors, a value the charset cannot encode
        return None
    if not spans:
        return None
    out, at = [], 0
    for start, end in spans:
        out += [body[at:start], new]
        at = end
    return b"".join([*out, body[at:]])


def _charset(raw: bytes) -> str:
    """The charset Starlette decodes a multipart form's fields with (latin-1 for one it does not know)."""
    try:
        return codecs.lookup(raw.decode("latin-1")).name
    except LookupError:
        return "latin-1"


class _Spans:
    """The (start, end) of each value of one field, as the parser's callbacks report them."""

    def __init__(self, body: bytes) -> None:
        self.body, self.spans, self.ok = body, [], True
        self.current: list[int] | None = None  # the span of the field being read, if it is the one wanted

    def begin(self, wanted: bool) -> None:
        self.current = [] if wanted else None

    def data(self, data: bytes, start: int, end: int) -> None:
        if self.current is None:
            return
        if data is not self.body or (self.current and self.current[1] != start):
            self.ok = False  # a piece the parser buffered, not a span of the body: no exact rewrite
        self.current[:] = [self.current[0] if self.current else start, end]

    def end(self) -> None:
        if self.current is not None:
            self.spans.append(tuple(self.current) if self.current else None)
        self.current = None

    def found(self) -> list[tuple[int, int]]:
        """Every value's span, or none if one of them has no bytes of its own to replace (empty)."""
        return [s for s in self.spans if s is not None] if self.ok and None not in self.spans else []


def _multipart_spans(body: bytes, boundary: bytes, name: bytes) -> list[tuple[int, int]]:
    from python_multipart.multipart import MultipartParser, parse_options_header

    spans, header, disposition = _Spans(body), [b"", b""], [b""]

    def header_end() -> None:
        if header[0].lower() == b"content-disposition":
            disposition[0] = header[1]
        header[:] = [b"", b""]

    def headers_finished() -> None:
        _, options = parse_options_header(disposition[0])
        spans.begin(options.get(b"name") == name and b"filename" not in options)  # a field, not a file
        disposition[0] = b""

    callbacks: Any = {
        "on_header_field": lambda d, s, e: header.__setitem__(0, header[0] + d[s:e]),
        "on_header_value": lambda d, s, e: header.__setitem__(1, header[1] + d[s:e]),
        "on_header_end": header_end,
        "on_headers_finished": headers_finished,
        "on_part_data": spans.data,
        "on_part_end": spans.end,
    }
    parser = MultipartParser(boundary, callbacks)
    parser.write(body)  # whole: every data callback is a span of ``body``
    parser.finalize()
    return spans.found()


def _urlencoded_spans(body: bytes, name: str) -> list[tuple[int, int]]:
    from urllib.parse import unquote_plus

    from python_multipart.multipart import QuerystringParser

    spans, field = _Spans(body), [b""]

    def field_name(data: bytes, start: int, end: int) -> None:
        field[0] += data[start:end]
        spans.begin(unquote_plus(field[0].decode("latin-1")) == name)  # as Starlette decodes a name

    def field_end() -> None:
        spans.end()
        field[0] = b""

    parser = QuerystringParser({"on_field_name": field_name, "on_field_data": spans.data, "on_field_end": field_end})
    parser.write(body)
    parser.finalize()
    return spans.found()
