"""The real HTTP ingress (``OpenAIIngress`` behind the listener's direct routes, CORS and hang-up
watch) driven in-process: a router that answers as vLLM does, and the real buckets in place of
the limiter actor. For tests of what the ingress itself decides: keys, limits, usage."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from atomr_infer.errors import DeploymentNotFound
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.serve.access_log import AccessLog
from atomr_infer.serve.answers import error_response
from atomr_infer.serve.api_keys import parse_key_file
from atomr_infer.serve.app import OpenAIIngress, api
from atomr_infer.serve.body import MAX_BODY_BYTES
from atomr_infer.serve.cors import Cors
from atomr_infer.serve.listener import cancel_on_hang_up, direct_posts
from atomr_infer.serve.rate_limit import Buckets, IngressLimits
from atomr_infer.serve.request_ids import with_request_ids
from atomr_infer.serve.routes import Via, paths
from atomr_infer.wire import HttpHead, LastBytes

JSON = ("content-type", "application/json")
USAGE = {"prompt_tokens": 10, "completion_tokens": 90, "total_tokens": 100}


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future


class Limiter:
    """The limiter actor's methods over real buckets, each call recorded."""

    def __init__(self) -> None:
        self.buckets = Buckets()
        self.calls: list[tuple[str, Any]] = []
        self.take = _Call(lambda *a: self._record("take", a, self.buckets.take(*a)))
        self.take_all = _Call(lambda asks: self._record("take_all", asks, self.buckets.take_all(asks)))

    def _record(self, name: str, args: Any, result: Any) -> Any:
        self.calls.append((name, args))
        return result


class Router:
    """Answers as vLLM does: SSE when the body streams (usage only when asked), else JSON with usage."""

    def __init__(self, table: RoutingTable) -> None:
        self.table = table
        self.seen: list[Any] = []

    async def refresh(self, force: bool = False) -> RoutingTable:
        return self.table

    async def stream(self, facts: Any, http: Any) -> Any:
        self.seen.append((facts, http))
        if self.table.find(facts.deployment) is None:
            raise DeploymentNotFound(facts.deployment, sorted(self.table.deployments))
        body = json.loads(http.body) if http.body.startswith(b"{") else {}  # else a form (audio)
        if facts.stream:
            yield HttpHead(200, (("content-type", "text/event-stream; charset=utf-8"),))
            yield b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            if (body.get("stream_options") or {}).get("include_usage") is True:
                yield f'data: {{"id":"c","choices":[],"usage":{json.dumps(USAGE)}}}\n\n'.encode()
            yield LastBytes(b"data: [DONE]\n\n")
        else:
            yield HttpHead(200, (JSON,))
            yield LastBytes(json.dumps({"id": "c", "choices": [], "usage": USAGE}).encode())


def ingress(keys_yaml: str | None = None, requests_per_minute: int | None = None,
            tokens_per_minute: int | None = None, request_id_headers: bool = False) -> tuple[Any, Limiter, Any]:
    """(the ingress, its limiter, the ASGI app, wrapped as its ``__init__`` wraps it) for one deployment ``smollm2``."""
    class Ingress(OpenAIIngress.func_or_class):  # type: ignore[misc, name-defined]
        def __del__(self) -> None:  # Serve's is a coroutine, awaited by a Serve replica: there is none
            pass

    ingress = Ingress.__new__(Ingress)  # no Ray Serve replica: its fields set here
    ingress._max_body_bytes = MAX_BODY_BYTES
    ring = parse_key_file(keys_yaml) if keys_yaml else None
    ingress._keys = type("Keys", (), {"ring": lambda self: ring, "stop": lambda self: None})() if ring else None
    ingress._limits = IngressLimits()
    ingress._limits._limiter = limiter = Limiter()
    route = DeploymentRoute("smollm2", 4, "queue", requests_per_minute=requests_per_minute,
                            tokens_per_minute=tokens_per_minute)
    ingress._router = Router(RoutingTable(1, {"smollm2": route}))
    ingress._access = AccessLog(lambda name: True)
    app = direct_posts(api, paths(Via.BODY), ingress.routed_by_body, error_response)
    return ingress, limiter, cancel_on_hang_up(with_request_ids(Cors().wrap(app), request_id_headers))


async def post(app: Any, path: str, body: dict[str, Any], key: str | None = None,
               extra: tuple[tuple[str, str], ...] = ()) -> tuple[int, dict[str, str], bytes]:
    """One POST through the ASGI app (``extra``: more request headers): (status, headers, body)."""
    return await post_raw(app, path, json.dumps(body).encode(), key, extra)


async def post_raw(app: Any, path: str, raw: bytes, key: str | None = None,
                   extra: tuple[tuple[str, str], ...] = ()) -> tuple[int, dict[str, str], bytes]:
    headers = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in extra)]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    done = asyncio.Event()
    out: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return out["status"], out["headers"], out["body"]
