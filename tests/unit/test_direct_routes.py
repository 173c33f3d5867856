"""Chat and completions called directly (engine/vllm/direct_routes.py) answer as vLLM's app does.

The app is vLLM's own, built as the replica builds it (``build_app``: its routes, middleware and
exception handlers); only the serving objects are stand-ins, since the real ones need an engine
(tests/integration/test_openai_replica.py and tests/e2e run the real ones through this path).
Each request is answered twice, directly and through the app, and the two answers must match.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from atomr_infer.engine.vllm.openai_app import HttpHead, HttpRequest, OpenAIApp, serve_args
from atomr_infer.spec import parse_deployment

JSON = (("content-type", "application/json"),)


class StandInServing:
    """A serving object that answers by the prompt (or the last message); records each call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []  # per call: the scope keys the app's routing sets, if any
        self.closed = asyncio.Event()  # a "hang" stream was closed

    async def _answer(self, request, raw_request, whole_type):
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

        self.calls.append({"routed": "endpoint" in raw_request.scope})
        raw_request.state.request_metadata = "set"  # as vLLM's serving objects do
        what = request.prompt if hasattr(request, "prompt") else request.messages[-1]["content"]
        if what == "stream":
            return self._stream(["data: one\n\n", "data: two\n\n", "data: [DONE]\n\n"])
        if what == "hang":
            return self._hang()
        if what == "hang-whole":  # as vLLM's serving objects answer a whole request cancelled
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.closed.set()
                return ErrorResponse(error=ErrorInfo(message="Client disconnected", type="BadRequestError", code=400))
        if what == "error":
            return ErrorResponse(error=ErrorInfo(message="no such thing", type="NotFoundError", code=404))
        if what == "value":
            raise ValueError("bad value")
        if what == "fails-midway":
            return self._fails_midway()
        if what == "boom":
            raise RuntimeError("boom")
        return whole_type(id="x", created=1, model="emu", choices=[], usage=UsageInfo())

    async def create_completion(self, request, raw_request):
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse

        return await self._answer(request, raw_request, CompletionResponse)

    async def create_chat_completion(self, request, raw_request):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        return await self._answer(request, raw_request, ChatCompletionResponse)

    async def _stream(self, events):
        for event in events:
            await asyncio.sleep(0)
            yield event

    async def _fails_midway(self):
        yield "data: first\n\n"
        raise ValueError("midway")

    async def _hang(self):
        try:
            yield "data: first\n\n"
            await asyncio.Event().wait()
        finally:
            self.closed.set()


@pytest.fixture(scope="module")
def vllm_app():
    from vllm.entrypoints.launchers.app import build_app

    args = serve_args(parse_deployment({"name": "emu", "model": "/models/emu", "device": "cpu"}), "/models/emu")
    return build_app(args, ("generate",), None)


@pytest.fixture
def serving(vllm_app):
    vllm_app.state.openai_serving_completion = vllm_app.state.openai_serving_chat = stand_in = StandInServing()
    return stand_in


def through_app(vllm_app) -> OpenAIApp:
    app = OpenAIApp(vllm_app)
    app._direct._routes = {}  # every request through the app
    return app


async def answer(app: OpenAIApp, request: HttpRequest) -> tuple[list, str | None]:
    items: list = []
    try:
        await app.run(request, items.append)
    except Exception as exc:  # noqa: BLE001 - compared below
        return items, f"{type(exc).__name__}: {exc}"
    return items, None


def completion(prompt, headers=JSON, path="/v1/completions", **extra) -> HttpRequest:
    return HttpRequest("POST", path, headers, json.dumps({"model": "emu", "prompt": prompt, **extra}).encode())


def chat(content, **extra) -> HttpRequest:
    body = {"model": "emu", "messages": [{"role": "user", "content": content}], **extra}
    return HttpRequest("POST", "/v1/chat/completions", JSON, json.dumps(body).encode())


@pytest.mark.parametrize(("request_", "status"), [
    (completion("stream", stream=True), 200), (completion("whole"), 200), (completion("error"), 404),
    (completion("value"), 400), (chat("stream", stream=True), 200), (chat("whole"), 200), (chat("error"), 404),
    (completion("whole", headers=(("Content-Type", "application/json; charset=utf-8"),)), 200),
    (completion("whole", headers=(*JSON, ("Origin", "https://example.com"))), 200),
], ids=["stream", "whole", "error-response", "value-error", "chat-stream", "chat-whole", "chat-error", "charset",
        "origin"])
def test_plain_requests_are_called_directly_and_answered_as_the_app_answers(vllm_app, serving, request_, status):
    direct = asyncio.run(answer(OpenAIApp(vllm_app), request_))
    assert direct == asyncio.run(answer(through_app(vllm_app), request_))
    assert serving.calls == [{"routed": False}, {"routed": True}]  # directly, then through the app
    head, *body = direct[0]
    assert isinstance(head, HttpHead) and head.status == status and body and direct[1] is None


def test_a_direct_answer_carries_the_apps_cors_headers():
    from vllm.entrypoints.launchers.app import build_app

    args = serve_args(parse_deployment({"name": "emu", "model": "/models/emu", "device": "cpu"}), "/models/emu")
    args.allowed_origins = ["https://example.com"]
    app = build_app(args, ("generate",), None)
    app.state.openai_serving_completion = serving = StandInServing()
    request = completion("stream", headers=(*JSON, ("Origin", "https://example.com")), stream=True)
    direct = asyncio.run(answer(OpenAIApp(app), request))
    assert direct == asyncio.run(answer(through_app(app), request))
    assert serving.calls == [{"routed": False}, {"routed": True}]
    assert ("access-control-allow-origin", "https://example.com") in direct[0][0].headers


@pytest.mark.parametrize(("prompt", "status", "error"), [
    ("boom", 500, "RuntimeError: boom"),  # only the catch-all handles it: answered, then raised
    ("fails-midway", 200, "RuntimeError: Caught handled exception, but response already started."),
])
def test_errors_that_the_app_raises_are_raised_alike(vllm_app, serving, prompt, status, error):
    request = completion(prompt, stream=True)
    direct = asyncio.run(answer(OpenAIApp(vllm_app), request))
    assert direct == asyncio.run(answer(through_app(vllm_app), request))
    assert direct[0][0].status == status and direct[1] == error
    assert serving.calls == [{"routed": False}, {"routed": True}]


@pytest.mark.parametrize(("request_", "status"), [
    (completion("whole", headers=(("content-type", "text/plain"),)), 400),
    (completion("whole", path="/v1/completions?x=1"), 200),
    (HttpRequest("POST", "/v1/completions", JSON, b"{not json"), 400),
    (completion(None), 400),  # no prompt: the model does not validate
    (HttpRequest("POST", "/v1/embeddings", JSON, json.dumps({"model": "emu", "input": "hi"}).encode()), 404),
], ids=["content-type", "query", "bad-json", "invalid", "other-route"])
def test_other_requests_go_through_the_app(vllm_app, serving, request_, status):
    items, error = asyncio.run(answer(OpenAIApp(vllm_app), request_))
    assert error is None and isinstance(items[0], HttpHead)
    assert all(call["routed"] for call in serving.calls)  # the stand-in ran only from the app, if at all
    assert (items, error) == asyncio.run(answer(through_app(vllm_app), request_))
    assert items[0].status == status


def test_cancelling_a_direct_stream_closes_vllms_generator(vllm_app, serving):
    async def main():
        items: list = []
        task = asyncio.create_task(OpenAIApp(vllm_app).run(completion("hang", stream=True), items.append))
        while len(items) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(serving.closed.wait(), 5)
        return items

    items = asyncio.run(main())
    assert items[0].status == 200 and items[1] == b"data: first\n\n"
    assert serving.calls == [{"routed": False}]


def test_a_cancelled_whole_request_ends_cancelled_with_nothing_sent(vllm_app, serving):
    async def main():
        items: list = []
        task = asyncio.create_task(OpenAIApp(vllm_app).run(completion("hang-whole"), items.append))
        while not serving.calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # not vLLM's "client disconnected" answer
            await task
        return items

    assert asyncio.run(main()) == [] and serving.closed.is_set()


def test_an_app_with_other_middleware_or_a_replaced_route_is_run_whole(vllm_app):
    from fastapi import FastAPI
    from starlette.middleware.gzip import GZipMiddleware
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    from atomr_infer.engine.vllm.direct_routes import eligible_routes

    def like_vllms(**kw) -> FastAPI:
        app = FastAPI(**kw)
        app.router.routes.extend(vllm_app.routes)
        return app

    assert set(eligible_routes(vllm_app)) == {"/v1/completions", "/v1/chat/completions"}
    assert set(eligible_routes(like_vllms())) == {"/v1/completions", "/v1/chat/completions"}
    with_more = like_vllms()
    with_more.add_middleware(GZipMiddleware)
    assert eligible_routes(with_more) == {}
    assert eligible_routes(like_vllms(debug=True)) == {}
    overridden = like_vllms()
    overridden.dependency_overrides[validate_json_request] = lambda: None
    assert eligible_routes(overridden) == {}

    replaced = FastAPI()

    @replaced.post("/v1/completions")
    async def plugin_completions():  # a plugin's route registered before vLLM's
        return {}

    replaced.router.routes.extend(vllm_app.routes)
    assert set(eligible_routes(replaced)) == {"/v1/chat/completions"}
    replaced.state.enable_server_load_tracking = True
    assert eligible_routes(replaced) == {}
