"""Chat and completions answered by vLLM's serving objects directly, as its routes call them,
without running its web framework around them.

Measured in the replica's thread (1,024 streamed two-token completions at once over the emulated
engine, AMD EPYC with avx512_bf16): through vLLM's FastAPI app a request cost 1.16 ms of CPU, of
which the serving object's call took 0.45 ms. The rest was Starlette's and FastAPI's own work:
three middlewares, matching the path against every route, solving the route's dependencies, the
streaming response's task group. A request that came over Ray, not a socket, needs none of it;
at a thousand requests opened at once it cost the replica's thread most of a second. Ray Serve
LLM's replicas call vLLM's serving objects the same way.

What answers is still vLLM's: its request model validates the body (as FastAPI does: the JSON,
then the model), its serving object answers, its exception handlers turn an exception into a
response, and the head is that of the response class its route returns, passed through the
app's own CORS middleware. Only a request whose answer cannot differ from the app's comes this
way; any other runs through the app, so vLLM answers it (its 4xx among them) exactly as
``vllm serve`` does:
- another path or method, or a query string;
- a content type other than JSON, or a body that does not validate;
- an app whose route for the path is not vLLM's own (a plugin's) or has other dependencies,
  with dependency overrides, middleware other than those below, debug on, or server load
  counted.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Middleware a direct call may leave out. CORS only adds headers to the head (its preflight
# answers OPTIONS, which never comes this way), and a direct answer's head gets them from the
# app's own CORS middleware; ScalingMiddleware answers 503 while an elastic expert-parallel
# engine rescales (atomr runs none); the Prometheus instrumentator counts HTTP requests in the
# replica's own registry, which nothing serves (atomr's metrics are the replica's stats).
SKIPPABLE_MIDDLEWARE = frozenset({
    "starlette.middleware.cors.CORSMiddleware",
    "vllm.entrypoints.serve.elastic_ep.middleware.ScalingMiddleware",
    "prometheus_fastapi_instrumentator.middleware.PrometheusInstrumentatorMiddleware",
})
JSON_CHECK = "vllm.entrypoints.serve.utils.api_utils.validate_json_request"  # the routes' one dependency
LOAD_METRICS_HEADER = "endpoint-load-metrics-format"  # vLLM's routes answer it with ORCA headers


@dataclass(frozen=True)
class Route:
    endpoint: str  # the module and name of vLLM's route function for the path
    model: Any  # its request model: the body
    whole: Any  # the response model of a request that does not stream
    serving: str  # the app.state attribute that holds the serving object
    method: str  # the serving object's method the route awaits


def vllm_routes() -> dict[str, Route]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse

    return {
        "/v1/chat/completions": Route(
            "vllm.entrypoints.openai.chat_completion.api_router.create_chat_completion",
            ChatCompletionRequest, ChatCompletionResponse, "openai_serving_chat", "create_chat_completion",
        ),
        "/v1/completions": Route(
            "vllm.entrypoints.openai.completion.api_router.create_completion",
            CompletionRequest, CompletionResponse, "openai_serving_completion", "create_completion",
        ),
    }


def eligible_routes(app: Any) -> dict[str, Route]:
    """The routes of ``vllm_routes`` that a POST to their path reaches in ``app`` unchanged."""
    from starlette.routing import Match

    if getattr(app.state, "enable_server_load_tracking", False) or app.debug or app.dependency_overrides:
        return {}
    if any(_name(m.cls) not in SKIPPABLE_MIDDLEWARE for m in app.user_middleware):
        return {}
    out = {}
    for path, route in vllm_routes().items():
        scope = {"type": "http", "path": path, "method": "POST", "root_path": "", "headers": []}
        reached = next((r for r in app.routes if r.matches(scope)[0] == Match.FULL), None)
        endpoint = getattr(reached, "endpoint", None)
        depends = [_name(d.dependency) for d in getattr(reached, "dependencies", ())]
        if endpoint is not None and _name(endpoint) == route.endpoint and depends == [JSON_CHECK]:
            out[path] = route
    return out


def _name(thing: Any) -> str:
    return f"{getattr(thing, '__module__', '')}.{getattr(thing, '__qualname__', '')}"


Head = Callable[[int, tuple[tuple[str, str], ...]], Any]  # a response's status and headers, as the caller sends them


class DirectRoutes:
    def __init__(self, app: Any, head: Head) -> None:
        self._app = app
        self._routes = eligible_routes(app)
        self._make_head = head
        self._cors = _cors_of(app)
        # Split as Starlette's app splits them: 500 and Exception go to its outermost middleware,
        # which answers, then raises; the others to its exception middleware, inside CORS.
        self._error_handler: Any = None
        self._status_handlers: dict[int, Any] = {}
        self._class_handlers: dict[type, Any] = {}
        for key, handler in app.exception_handlers.items():
            if key in (500, Exception):
                self._error_handler = handler
            elif isinstance(key, int):
                self._status_handlers[key] = handler
            else:
                self._class_handlers[key] = handler

    def route_of(self, method: str, path: str, headers: tuple[tuple[str, str], ...]) -> Route | None:
        """The route to call directly for this request, or None: run it through the app."""
        route = self._routes.get(path) if method == "POST" else None  # a query string: no match
        if route is None:
            return None
        content_type = next((v for k, v in headers if k.lower() == "content-type"), "")
        # vLLM's validate_json_request, which the app would answer 400
        return route if content_type.lower().split(";", maxsplit=1)[0] == "application/json" else None

    async def run(self, route: Route, body: bytes, scope: dict[str, Any], put: Callable[[Any], None]) -> bool:
        """Answer through ``put`` (the head, then the body's pieces). False, having done nothing,
        if the body does not validate: the app answers that, in vLLM's words."""
        from fastapi import Request

        try:
            request = route.model.model_validate(json.loads(body))
        except Exception:  # noqa: BLE001 - any way it fails, the app says how
            return False
        serving = getattr(self._app.state, route.serving, None)
        if serving is None:  # the model does not serve this API: the app's route says so
            return False
        raw = Request(scope, _receive(body))
        try:
            result = await getattr(serving, route.method)(request, raw)
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # (vLLM needs Python >= 3.11, as this does)
                # vLLM answers a cancelled whole request "client disconnected"; nobody reads it.
                raise asyncio.CancelledError
            response = self._response(route, result, raw)
        except Exception as exc:  # noqa: BLE001 - answered as the app's handlers answer it
            await self._answer_error(raw, exc, put)
            return True
        put(await self._head(response, raw))
        iterator = getattr(response, "body_iterator", None)
        if iterator is None:
            if response.body:
                put(response.body)
            return True
        try:
            async for piece in iterator:
                if piece:
                    put(piece if isinstance(piece, bytes) else piece.encode(response.charset))
        except Exception as exc:
            if self._handler_for(exc) is not None:  # as Starlette's exception middleware says it
                raise RuntimeError("Caught handled exception, but response already started.") from exc
            raise
        finally:
            await iterator.aclose()  # also when cancelled: the request's end aborts it in the engine
        return True

    @staticmethod
    def _response(route: Route, result: Any, raw: Any) -> Any:
        """What vLLM's route returns for the serving object's ``result``."""
        from fastapi.responses import JSONResponse, StreamingResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.utils.orca_metrics import metrics_header
        from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive

        if isinstance(result, ErrorResponse):
            return JSONResponse(content=result.model_dump(), status_code=result.error.code)
        if isinstance(result, route.whole):
            orca = metrics_header(raw.headers.get(LOAD_METRICS_HEADER, ""))
            return JSONResponse(content=result.model_dump(), headers=orca)
        interval = getattr(getattr(raw.app.state, "args", None), "sse_keep_alive_interval", 0)
        return StreamingResponse(content=with_sse_keep_alive(result, float(interval)), media_type="text/event-stream")

    def _plain_head(self, response: Any) -> Any:
        return self._head_of(response.status_code, response.raw_headers)

    def _head_of(self, status: int, raw_headers: list[tuple[bytes, bytes]]) -> Any:
        return self._make_head(status, tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers))

    async def _head(self, response: Any, raw: Any) -> Any:
        """The head as the app sends it: through its CORS middleware, run as ASGI around it."""
        if self._cors is None:
            return self._plain_head(response)
        start = {"type": "http.response.start", "status": response.status_code, "headers": list(response.raw_headers)}
        sent: list[dict[str, Any]] = []

        async def keep(message: dict[str, Any]) -> None:
            sent.append(message)

        await self._cors({**raw.scope, HEAD_KEY: start}, raw.receive, keep)
        return self._head_of(sent[0]["status"], sent[0]["headers"])

    def _handler_for(self, exc: Exception) -> Any:
        """The exception middleware's handler for ``exc``, as Starlette looks it up, or None."""
        from starlette.exceptions import HTTPException

        if isinstance(exc, HTTPException) and exc.status_code in self._status_handlers:
            return self._status_handlers[exc.status_code]
        return next((self._class_handlers[c] for c in type(exc).__mro__ if c in self._class_handlers), None)

    async def _answer_error(self, raw: Any, exc: Exception, put: Callable[[Any], None]) -> None:
        """As Starlette's middleware would: the handler of the exception's nearest class answers;
        one that only the app's catch-all (500 or ``Exception``) handles is answered, then raised."""
        from starlette.responses import PlainTextResponse

        handler = self._handler_for(exc)
        caught = handler is not None
        handler = handler or self._error_handler
        response = handler(raw, exc) if handler else PlainTextResponse("Internal Server Error", 500)
        if inspect.isawaitable(response):
            response = await response
        if response is not None:
            # The catch-all's answer comes from the outermost middleware, outside CORS.
            put(await self._head(response, raw) if caught else self._plain_head(response))
            if response.body:
                put(response.body)
        if not caught:
            raise exc


HEAD_KEY = "atomr.direct_head"  # the scope key that hands a direct answer's head to _send_head


async def _send_head(scope: Any, receive: Any, send: Any) -> None:
    await send(scope[HEAD_KEY])


def _cors_of(app: Any) -> Any:
    """The app's CORS middleware as it configured it, around ``_send_head``; or None."""
    from starlette.middleware.cors import CORSMiddleware

    entry = next((m for m in app.user_middleware if m.cls is CORSMiddleware), None)
    return None if entry is None else CORSMiddleware(_send_head, *entry.args, **entry.kwargs)


def _receive(body: bytes) -> Callable[[], Any]:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect message: a consumer that leaves cancels us
        return {"type": "http.disconnect"}

    return receive
