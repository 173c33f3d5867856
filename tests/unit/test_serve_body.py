"""Hostile request bodies become typed 4xx errors, never a 500 (serve/body.py, serve/errors.py)."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from atomr_infer.errors import InvalidRequest, RequestTooLarge
from atomr_infer.serve.body import MAX_JSON_DEPTH, json_depth, parse_json, read_body
from atomr_infer.serve.errors import http_error


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


def read(parts, content_length=None, limit=10):
    return asyncio.run(read_body(_chunks(*parts), content_length, limit))


def test_body_within_the_limit_is_read_whole():
    assert read([b"12345", b"67890"], "10") == b"1234567890"


def test_declared_or_streamed_size_over_the_limit_is_413_naming_it():
    with pytest.raises(RequestTooLarge) as info:
        read([b"x"], "11")
    assert info.value.size == 11
    with pytest.raises(RequestTooLarge):
        read([b"123456", b"789012"])  # chunked: no Content-Length
    err = http_error(info.value)
    assert err.status == 413 and "10 bytes" in err.message and err.param == "body"
    again = pickle.loads(pickle.dumps(info.value))  # crosses Ray like every AtomrError
    assert (again.limit, again.size, str(again)) == (10, 11, str(info.value))


def test_bad_content_length_is_400():
    with pytest.raises(InvalidRequest, match="Content-Length"):
        read([b"{}"], "ten")


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"model": "\xff\xfe"}', "not valid UTF-8"),
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
        (b'{"temperature": -Infinity}', "Infinity is not a JSON number"),
        (b"[" * 100_000, "nests deeper"),  # Python's json raises RecursionError here
        (b"[" * 200 + b"]" * 200, "nests deeper"),  # parses, but deeper than the limit
        (b'{"a": ' * 65 + b"1" + b"}" * 65, "nests deeper"),
        (b'{"model": "x",}', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_hostile_json_is_an_invalid_body(raw, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        parse_json(raw)
    assert info.value.field == "body"
    assert http_error(info.value).status == 400


def test_ordinary_bodies_parse():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    import json

    assert parse_json(json.dumps(body).encode()) == body
    assert json_depth(body, MAX_JSON_DEPTH) == 5
    assert json_depth(1, MAX_JSON_DEPTH) == 0


@pytest.mark.parametrize("raw", [
    b'\xef\xbb\xbf{"model": "m", "prompt": "caf\xc3\xa9"}',  # UTF-8 with a byte-order mark
    '{"model": "m", "prompt": "café"}'.encode("utf-16"),
    '{"model": "m", "prompt": "café"}'.encode("utf-32-le"),
])
def test_a_body_in_any_json_encoding_is_read_as_vllms_routes_read_it(raw):
    """vLLM's routes (json.loads of the bytes) read these; the ingress answered 400 "not valid UTF-8"."""
    assert parse_json(raw) == json.loads(raw) == {"model": "m", "prompt": "café"}


def test_a_body_in_utf16_reaches_the_replica_as_utf8_so_what_the_ingress_adds_fits_it():
    """The router writes a Responses request's id into its body: into UTF-16 bytes, corrupt."""
    from tests.unit.ingress_app import ingress, post_raw

    ingress_, _limiter, app = ingress()
    body = '{"model": "smollm2", "input": "café"}'.encode("utf-16")
    status, _headers, _answer = asyncio.run(post_raw(app, "/v1/responses", body))
    [(facts, http)] = ingress_._router.seen
    assert status == 200 and json.loads(http.body.decode("utf-8"))["input"] == "café"
    from atomr_infer.routing.response_ids import with_request_id  # as the router names the response

    assert json.loads(with_request_id(http, "resp_smollm2.r0.x").body)["request_id"] == "resp_smollm2.r0.x"
