"""``--enable-request-id-headers`` (serve/request_ids.py): every answer of the ingress carries an
``X-Request-Id``, the request's own or a fresh uuid4 hex, as ``vllm serve``'s flag does; driven
through the real ingress in-process (tests/unit/ingress_app.py)."""

from __future__ import annotations

import asyncio
import re

import pytest

from atomr_infer.errors import AtomrError
from tests.unit.ingress_app import ingress, post, post_raw

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
KEYS = "keys:\n  - name: team\n    key: sk-team-key-1\n"
HEX = re.compile(r"[0-9a-f]{32}")


def answer(path: str = "/v1/chat/completions", body: dict | None = None, on: bool = True, key: str | None = None,
           keys: str | None = None, request_id: str | None = None) -> tuple[int, dict[str, str], bytes]:
    _, _, app = ingress(keys, request_id_headers=on)
    extra = (("X-Request-Id", request_id),) if request_id is not None else ()
    return asyncio.run(post(app, path, CHAT if body is None else body, key, extra))


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "stream": True}], ids=["plain", "stream"])
def test_the_replicas_answer_carries_the_requests_own_id(body):
    status, headers, out = answer(body=body, request_id="abc-123")
    assert status == 200 and headers["x-request-id"] == "abc-123"
    assert out.endswith(b"data: [DONE]\n\n") if body.get("stream") else out.startswith(b'{"id"')


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "stream": True}], ids=["plain", "stream"])
def test_without_one_each_answer_gets_a_fresh_uuid4_hex(body):
    first, second = answer(body=body)[1]["x-request-id"], answer(body=body)[1]["x-request-id"]
    assert HEX.fullmatch(first) and HEX.fullmatch(second) and first != second


@pytest.mark.parametrize(("path", "body", "key", "status"), [
    ("/v1/chat/completions", {**CHAT, "model": "gemma"}, "sk-team-key-1", 404),  # no such deployment (atomr's)
    ("/v1/chat/completions", CHAT, None, 401),  # no API key
    ("/v1/chat/completions", CHAT, "sk-wrong-key-1", 401),
    ("/v1/nothing", CHAT, "sk-team-key-1", 404),  # no such route (the app's own)
    ("/sleep", {}, "sk-team-key-1", 404),  # a route of vLLM's that atomr does not serve
])
def test_errors_of_atomrs_own_carry_it_too(path, body, key, status):
    got, headers, _ = answer(path, body, key=key, keys=KEYS, request_id="mine")
    assert got == status and headers["x-request-id"] == "mine"
    got, headers, _ = answer(path, body, key=key, keys=KEYS)
    assert got == status and HEX.fullmatch(headers["x-request-id"])


def test_a_refused_body_carries_it():
    _, _, app = ingress(request_id_headers=True)
    status, headers, _ = asyncio.run(post_raw(app, "/v1/chat/completions", b"{not json"))
    assert status == 400 and HEX.fullmatch(headers["x-request-id"])


def test_off_by_default_no_answer_carries_it():
    _, _, app = ingress(KEYS)
    for path, body, key in (("/v1/chat/completions", CHAT, "sk-team-key-1"), ("/v1/chat/completions", CHAT, None),
                            ("/v1/chat/completions", {**CHAT, "stream": True}, "sk-team-key-1")):
        status, headers, _ = asyncio.run(post(app, path, body, key, (("X-Request-Id", "mine"),)))
        assert status in (200, 401) and "x-request-id" not in headers


@pytest.mark.parametrize("on", [True, False])
def test_the_incoming_id_is_forwarded_to_the_replica_and_none_is_made_up_for_it(on):
    ingress_, _, app = ingress(request_id_headers=on)
    asyncio.run(post(app, "/v1/chat/completions", CHAT, extra=(("X-Request-Id", "abc"),)))
    asyncio.run(post(app, "/v1/chat/completions", CHAT))
    (_, given), (_, none) = ingress_._router.seen
    assert [v for k, v in given.headers if k.lower() == "x-request-id"] == ["abc"]
    assert not any(k.lower() == "x-request-id" for k, _ in none.headers)  # as vLLM: its own id, not the header's



def test_an_update_in_place_keeps_the_setting_unless_given():
    from atomr_infer.serve.server import Server, api_settings

    running = Server("h", 1, False, {"request_id_headers": True})
    assert api_settings(running, "h", 1, None, None, None)["request_id_headers"] is True
    assert api_settings(running, "h", 1, None, None, None, request_id_headers=False)["request_id_headers"] is False
    assert api_settings(None, "h", 1, None, None, None)["request_id_headers"] is False  # vLLM's default: off
    assert api_settings(None, "h", 1, None, None, None, request_id_headers=True)["request_id_headers"] is True


@pytest.mark.parametrize("args", [["serve"], ["up", "--no-gemma", "--serve"]])
@pytest.mark.parametrize(("flag", "expected"), [
    ([], False), (["--enable-request-id-headers"], True), (["--no-enable-request-id-headers"], False)])
def test_the_flag_reaches_run_server(args, flag, expected, monkeypatch):
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import atomr_infer.serve as serve_package
    from atomr_infer import cluster
    from atomr_infer.cli import common
    from atomr_infer.cli.main import app

    given: list[dict] = []

    def run_server(*args, **kwargs):
        given.append(kwargs)
        raise AtomrError("stopped here")

    monkeypatch.setattr(common, "check_api_before_start", lambda *a: None)
    monkeypatch.setattr(common, "connect", lambda *a, **k: None)
    monkeypatch.setattr(common, "control_plane", lambda *a, **k: SimpleNamespace(list=lambda: []))
    monkeypatch.setattr(common, "dashboard_url", lambda: None)
    monkeypatch.setattr(cluster, "target_address", lambda address=None: "127.0.0.1:6379")
    monkeypatch.setattr(cluster, "use_local_auth_token", lambda: None)
    monkeypatch.setattr(serve_package, "running_server", lambda: None)
    monkeypatch.setattr(serve_package, "run_server", run_server)
    result = CliRunner().invoke(app, [*args, *flag])
    assert result.exit_code == 1 and "stopped here" in result.output, result.output
    assert given[0]["request_id_headers"] is expected


def test_up_says_the_flag_needs_serve():
    from typer.testing import CliRunner

    from atomr_infer.cli.main import app

    result = CliRunner().invoke(app, ["up", "--no-gemma", "--enable-request-id-headers"])
    assert result.exit_code == 2 and "--enable-request-id-headers" in result.output, result.output


@pytest.mark.parametrize("on", [True, False])
def test_run_server_gives_it_to_the_ingress_replicas_and_records_it(on, monkeypatch):
    from ray import serve

    from atomr_infer import cluster
    from atomr_infer.control import client
    from atomr_infer.serve import listener, server

    deployed, recorded = [], []
    monkeypatch.setattr(cluster, "connect", lambda address=None, start=True: None)
    monkeypatch.setattr(server, "running_server", lambda: None)
    monkeypatch.setattr(server, "_this_node", lambda: {})
    monkeypatch.setattr(server, "_start_serve", lambda: False)
    monkeypatch.setattr(server, "_record", recorded.append)
    monkeypatch.setattr(listener, "check_free", lambda host, port: None)
    monkeypatch.setattr(client, "manager_handle", lambda address=None, start=True: None)
    monkeypatch.setattr(serve, "_run", lambda app, **kw: deployed.append(app))
    server.run_server("127.0.0.1", 8000, request_id_headers=on)
    assert deployed[0]._bound_deployment.init_kwargs["request_id_headers"] is on
    assert recorded[0].settings["request_id_headers"] is on


def test_a_cors_preflight_carries_it_as_the_flag_wraps_cors():
    import httpx

    _, _, app = ingress(request_id_headers=True)

    async def preflight() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            return await client.options("/v1/chat/completions", headers={
                "origin": "https://page.example", "access-control-request-method": "POST", "x-request-id": "pre"})

    reply = asyncio.run(preflight())
    assert reply.status_code == 400 and reply.headers["x-request-id"] == "pre"  # refused: no origin is allowed
