"""The API's CORS (serve/cors.py): the flags' values, and Starlette's middleware as the ingress
wraps its app with them. Against ``vllm serve``'s own answers: tests/e2e/test_conformance.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from atomr_infer.errors import AtomrError
from atomr_infer.serve.cors import Cors, cors_list


@pytest.mark.parametrize(("value", "expected"), [
    ("*", ("*",)),
    ('["https://a.example", "https://b.example"]', ("https://a.example", "https://b.example")),
    ("https://a.example, https://b.example", ("https://a.example", "https://b.example")),
    ("GET", ("GET",)),
    ("[]", ()),  # vLLM's default, given explicitly: `vllm serve --allowed-origins '[]'` takes it
])
def test_a_flag_takes_vllms_json_list_or_a_comma_separated_one(value, expected):
    assert cors_list("--allowed-origins", value) == expected


@pytest.mark.parametrize(("value", "says"), [
    ('["https://a.example"', "is not a JSON list"),
    ('["https://a.example", 3]', "is not a list of strings"),
    ("a,,b", "has an empty entry"),
])
def test_a_bad_value_is_one_line_naming_the_flag_and_the_value(value, says):
    with pytest.raises(AtomrError) as info:
        cors_list("--allowed-origins", value)
    assert str(info.value).startswith(f"--allowed-origins: {value!r} {says}"), info.value


def answers(cors: Cors, method: str, headers: dict[str, str]) -> httpx.Response:
    async def models(_request):
        return JSONResponse({"data": []})

    app = cors.wrap(Starlette(routes=[Route("/v1/models", models, methods=["GET", "POST"])]))

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return await client.request(method, "/v1/models", headers=headers)

    return asyncio.run(call())


PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}


def test_by_default_no_page_on_another_origin_may_call_it_as_on_vllm_serve():
    reply = answers(Cors(), "OPTIONS", {"origin": "https://app.example", **PREFLIGHT})
    assert reply.status_code == 400 and "access-control-allow-origin" not in reply.headers
    plain = answers(Cors(), "GET", {"origin": "https://app.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers  # the browser drops it


def test_any_origin_when_asked():
    cors = Cors(allowed_origins=("*",))
    reply = answers(cors, "OPTIONS", {"origin": "https://app.example", **PREFLIGHT})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    plain = answers(cors, "GET", {"origin": "https://app.example"})
    assert plain.status_code == 200 and plain.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in answers(cors, "GET", {}).headers  # no origin: no CORS


def test_only_the_origins_allowed_get_an_answer_a_browser_accepts():
    cors = Cors(allowed_origins=("https://app.example",), allowed_methods=("POST",), allow_credentials=True)
    allowed = answers(cors, "OPTIONS", {"origin": "https://app.example", **PREFLIGHT})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    refused = answers(cors, "OPTIONS", {"origin": "https://evil.example", **PREFLIGHT})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    wrong_method = answers(cors, "OPTIONS", {"origin": "https://app.example", **PREFLIGHT,
                                             "access-control-request-method": "DELETE"})
    assert wrong_method.status_code == 400
    assert "access-control-allow-origin" not in answers(cors, "GET", {"origin": "https://evil.example"}).headers


def test_an_update_in_place_keeps_what_it_is_not_given():
    from atomr_infer.serve.server import Server, api_settings

    running = Server("127.0.0.1", 8000, False, {"api_keys_path": "/keys.yaml", "max_body_bytes": 1024,
                                                "cors": {"allowed_origins": ["https://a.example"],
                                                         "allowed_methods": ["*"], "allowed_headers": ["*"],
                                                         "allow_credentials": True}})
    cors = Cors(allowed_origins=("https://b.example",))
    assert api_settings(running, "127.0.0.1", 8000, None, None, cors) == {
        "api_keys_path": "/keys.yaml", "max_body_bytes": 1024, "cors": cors, "request_id_headers": False}
    kept = api_settings(running, "127.0.0.1", 8000, "/other.yaml", 2048, None)
    assert kept["api_keys_path"] == "/other.yaml" and kept["max_body_bytes"] == 2048
    assert kept["cors"] == Cors(("https://a.example",), ("*",), ("*",), True)
    nothing = {"api_keys_path": None, "max_body_bytes": None, "cors": None, "request_id_headers": False}
    assert api_settings(Server("h", 1, False), "h", 1, None, None, None) == nothing
    assert api_settings(running, "127.0.0.1", 8001, None, None, None) == nothing  # another address: a new API
    assert api_settings(None, "h", 1, None, None, None) == nothing
