"""The ingress's own part of the HTTP API (no Ray): routing by ``model``, our errors as OpenAI
errors, and a replica failure in the middle of a stream. Everything else is vLLM's, in the
replica (tests/integration/test_openai_replica.py, tests/e2e/test_conformance.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from atomr_infer.errors import (
    CapacityExhausted,
    DeploymentNotFound,
    EngineError,
    InvalidRequest,
    NoReadyReplica,
)
from atomr_infer.serve.answers import relay as _relay
from atomr_infer.serve.errors import ManagerUnreachable, http_error
from atomr_infer.wire import RequestKind, RoutingFacts


def test_error_statuses_and_bodies():
    cases = {
        DeploymentNotFound("x", ["smollm2"]): (404, "model_not_found"),
        InvalidRequest("temperature", "bad"): (400, "invalid_value"),
        CapacityExhausted("x", 1, 2.5): (429, "capacity_exhausted"),
        NoReadyReplica("x", 3.0): (503, "no_ready_replica"),
        ManagerUnreachable("restarting"): (503, "manager_unreachable"),
        EngineError("boom"): (500, "engine_error"),
        RuntimeError("bug"): (500, "internal_error"),
    }
    for exc, (status, code) in cases.items():
        err = http_error(exc)
        assert (err.status, err.code) == (status, code), exc
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert http_error(CapacityExhausted("x", 1, 2.5)).headers == {"Retry-After": "3"}
    assert http_error(InvalidRequest("temperature", "bad")).param == "temperature"


def _model_of(body):
    return RoutingFacts.of("/v1/chat/completions", body).deployment


def test_the_model_field_names_the_deployment():
    assert _model_of({"model": "smollm2", "messages": []}) == "smollm2"
    facts = RoutingFacts.of("/v1/completions?x=1", {"model": "m", "prompt": "p", "previous_response_id": "resp_1"})
    assert (facts.kind, facts.prompt, facts.response_id, facts.stream) == (RequestKind.COMPLETION, "p", "resp_1", False)
    assert RoutingFacts.of("/v1/audio/speech", {"model": "m"}).kind is RequestKind.OTHER
    for body, field in (({"messages": []}, "model"), ({"model": 5}, "model"), ({"model": ""}, "model"),
                        (["x"], "body"), (None, "body")):
        with pytest.raises(InvalidRequest) as info:
            _model_of(body)
        assert info.value.field == field


def test_a_replica_failure_mid_stream_ends_with_an_error_event_then_done():
    closed = []

    async def items():
        try:
            yield b'data: {"a": 1}\n\n'
            raise EngineError("replica atomr:d:r0 died mid-request")
        finally:
            closed.append(True)

    async def main():
        return [e async for e in _relay(items())]

    events = asyncio.run(main())
    assert events[0] == b'data: {"a": 1}\n\n'
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "engine_error" and "died mid-request" in error["message"]
    assert events[2] == b"data: [DONE]\n\n" and closed == [True]


def test_errors_on_anthropics_routes_come_in_its_shape():
    from atomr_infer.serve.answers import error_response
    from atomr_infer.serve.api_keys import ApiKeyError

    cases = {
        ApiKeyError(401, "invalid API key", "invalid_api_key"): (401, "authentication_error"),
        ApiKeyError(403, "may not", "model_not_allowed"): (403, "permission_error"),
        DeploymentNotFound("x", []): (404, "not_found_error"),
        InvalidRequest("body", "bad"): (400, "invalid_request_error"),
        CapacityExhausted("x", 1): (429, "rate_limit_error"),
        NoReadyReplica("x"): (503, "overloaded_error"),
        EngineError("boom"): (500, "api_error"),
    }
    for exc, (status, kind) in cases.items():
        answer = error_response(exc, "/v1/messages")
        body = json.loads(answer.body)
        assert answer.status_code == status and body["type"] == "error" and body["error"]["type"] == kind, exc
        assert set(body["error"]) == {"type", "message"}
    assert "error" in json.loads(error_response(EngineError("boom"), "/v1/messages/count_tokens").body)
    openai_shaped = json.loads(error_response(EngineError("boom"), "/v1/chat/completions").body)
    assert openai_shaped["error"]["code"] == "engine_error"


@pytest.mark.parametrize("kind", [RequestKind.MESSAGES, RequestKind.RESPONSES])
def test_a_typed_stream_ends_with_its_own_error_event(kind):
    async def items():
        yield b"event: x\ndata: {}\n\n"
        raise EngineError("replica died")

    async def main():
        return [e async for e in _relay(items(), kind)]

    events = asyncio.run(main())
    assert len(events) == 2 and events[1].startswith(b"event: error\n") and b"[DONE]" not in events[1]
    assert json.loads(events[1].split(b"data: ")[1])["type"] == "error"


def test_responses_and_messages_facts():
    facts = RoutingFacts.of("/v1/responses", {"model": "m", "input": "hi", "stream": True})
    assert (facts.kind, facts.prompt, facts.usage_wanted) == (RequestKind.RESPONSES, "hi", True)
    assert facts.names_response
    assert not RoutingFacts.of("/v1/responses", {"model": "m", "input": [], "request_id": "mine"}).names_response
    ask = [{"role": "user", "content": "x"}]
    facts = RoutingFacts.of("/v1/messages", {"model": "m", "messages": ask, "stream": True})
    assert (facts.kind, facts.usage_wanted, facts.names_response) == (RequestKind.MESSAGES, True, False)


def test_a_forms_model_is_read_from_multipart_and_urlencoded_bodies():
    import httpx

    from atomr_infer.serve.answers import form_model

    multipart = httpx.Request("POST", "http://x", data={"model": "whisper"}, files={"file": ("a.wav", b"RIFF")})
    multipart.read()
    assert asyncio.run(form_model(multipart.content, multipart.headers["content-type"])) == "whisper"
    assert asyncio.run(form_model(b"model=w2&x=1", "application/x-www-form-urlencoded")) == "w2"
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(form_model(b"{}", "application/json"))
    assert info.value.field == "body"


def test_an_unexpected_500_is_logged_with_its_traceback_and_ours_without(monkeypatch):
    """Before and mid-stream. (The module's logger is made again inside the capture: a logger
    bound before a reconfigure, as the CLI makes, keeps the processors it was made with.)"""
    from structlog.testing import capture_logs

    from atomr_infer.log import get_logger
    from atomr_infer.serve import answers

    def broken() -> None:
        raise KeyError("missing")

    try:
        broken()
    except KeyError as exc:
        unexpected: Exception = exc

    async def failing(exc: Exception):
        yield b"data: {}\n\n"
        raise exc

    async def relayed(exc: Exception) -> list[bytes]:
        return [e async for e in _relay(failing(exc))]

    with capture_logs() as logs:
        monkeypatch.setattr(answers, "log", get_logger(answers.__name__))
        assert answers.error_response(unexpected).status_code == 500
        assert answers.error_response(EngineError("boom")).status_code == 500
        asyncio.run(relayed(unexpected))
        asyncio.run(relayed(EngineError("boom")))
    assert [entry["event"] for entry in logs] == ["request_failed"] * 2 + ["stream_failed"] * 2
    assert unexpected.__traceback__ is not None
    assert [entry.get("exc_info") for entry in logs] == [unexpected, None, unexpected, None]


def test_what_runs_no_engine_step_is_charged_no_tokens():
    """A stored response retrieved (as a stream) was charged, and counted, its usage again each time."""
    from atomr_infer.serve.access_log import AccessLog

    charged: list = []
    usage = b'data: {"type": "response.completed", "response": {"usage": {"total_tokens": 900}}}\n\n'

    async def replay():
        yield usage

    async def main(counts):
        log = AccessLog()
        async for _ in log.stream(replay(), None, "d", 200, 0.0, charged.append, counts_tokens=counts):
            pass

    asyncio.run(main(True))
    asyncio.run(main(False))
    assert charged == [900, None]
    assert not RequestKind.STORED.runs_engine and not RequestKind.of_path("/v1/completions/render").runs_engine


def test_a_responses_error_event_is_numbered_after_the_last_so_the_openai_client_reads_it():
    """Without a sequence_number, the openai client's resuming stream (starting_after) compared
    None with an int: a TypeError, and the user never saw the error."""
    import httpx
    import openai

    created = {"type": "response.created", "sequence_number": 4, "response": {
        "id": "resp_d.r0.x", "object": "response", "created_at": 0, "model": "d", "output": [],
        "status": "in_progress", "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}}

    async def items():
        yield f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
        raise EngineError("replica atomr:d:r0 died mid-request")

    async def main():
        return b"".join([e async for e in _relay(items(), RequestKind.STORED)])

    body = asyncio.run(main())
    assert json.loads(body.split(b"data: ")[-1])["sequence_number"] == 5
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body))
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="k", http_client=httpx.Client(transport=transport))
    with client.responses.stream(response_id="resp_d.r0.x", starting_after=3) as stream:
        events = [event for event in stream]
    assert [e.type for e in events] == ["response.created", "error"]
    assert "died mid-request" in events[-1].message


def test_stopping_the_ingress_aborts_a_request_past_the_grace_then_closes_its_router(monkeypatch):
    """Serve's stop of an ingress replica (its ``__del__``): a request still open at the grace is
    cancelled, so the router's finally aborts it in the replica, and then the router is closed
    (over real uvicorn on loopback)."""
    import httpx

    from atomr_infer.local_ray import free_port
    from atomr_infer.serve import app as app_module
    from atomr_infer.serve.answers import error_response
    from atomr_infer.serve.listener import HttpListener, direct_posts, listen
    from atomr_infer.serve.routes import Via, paths
    from tests.unit.ingress_app import Router, ingress
    from tests.waiting import await_until

    events: list[str] = []

    class HangingRouter(Router):
        async def stream(self, facts, http):
            events.append("routed")
            try:
                await asyncio.sleep(30)  # the engine still generating
                yield b""
            finally:
                events.append("aborted in the replica")

        async def aclose(self) -> None:
            events.append("router closed")

    # Serve's decorators pickled the class: its methods read a copy of the module's globals.
    stop = next(c.__del__ for c in app_module.OpenAIIngress.func_or_class.__mro__
                if getattr(vars(c).get("__del__"), "__qualname__", "") == "OpenAIIngress.__del__")
    monkeypatch.setitem(stop.__globals__, "GRACEFUL_STOP_S", 0.5)

    async def run() -> None:
        server, _, _ = ingress()
        server._router = HangingRouter(server._router.table)
        server._keys, server._tables = None, type("Tables", (), {"stop": lambda self: None})()
        port = free_port()
        asgi = direct_posts(app_module.api, paths(Via.BODY), server.routed_by_body, error_response)
        server._listener = HttpListener(asgi, listen("127.0.0.1", port))
        server._listener.start()
        async with httpx.AsyncClient(timeout=10.0) as client:
            body = {"model": "smollm2", "messages": []}
            request = asyncio.ensure_future(client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body))
            assert await await_until(lambda: "routed" in events, 5.0)
            await app_module.OpenAIIngress.func_or_class.__del__(server)  # as Serve calls it
            assert events == ["routed", "aborted in the replica", "router closed"]
            assert (await asyncio.wait_for(request, 5.0)).status_code == 500

    asyncio.run(run())


def test_a_model_name_no_deployment_has_is_cut_in_the_access_log(monkeypatch):
    """It was logged as sent: a 4 MB name made a 4 MB log line (no key needed on an API without keys)."""
    from types import SimpleNamespace

    from atomr_infer.serve import access_log
    from tests.unit.ingress_app import ingress, post

    lines: list[tuple[str, int]] = []  # recorded, not captured: a test before may have set a level above INFO
    monkeypatch.setattr(access_log, "log", SimpleNamespace(
        info=lambda event, deployment, status, **fields: lines.append((deployment, status))))
    server, _, app = ingress()
    server._access = access_log.AccessLog(server._router.table.knows)
    for model in ("x" * 4_000_000, "y" * 128, "smollm2"):
        asyncio.run(post(app, "/v1/chat/completions", {"model": model, "messages": []}))
    assert lines == [("x" * 128 + "…", 404), ("y" * 128, 404), ("smollm2", 200)]
