"""``Client``: the OpenAI API of your deployments from Python, routed straight to replicas.

    client = atomr_infer.Client()
    reply = client.chat("smollm2", [{"role": "user", "content": "Hi"}], max_tokens=32)
    print(reply.choices[0].message.content)
    for chunk in client.stream_chat("smollm2", messages):
        print(chunk.choices[0].delta.content or "", end="", flush=True)

Keyword arguments are the fields of the OpenAI request (``temperature``, ``tools``,
``response_format``, vLLM's ``top_k``, ``ignore_eos``, …; and ``timeout``, seconds for the whole
answer of a call that does not stream, and for each piece of a stream, as openai's), checked by
name here: a misspelt
field raises ``TypeError`` in the caller, before anything is routed. Values are checked once,
by vLLM in the replica, which answers with vLLM's own response types (``ChatCompletionResponse``,
``ChatCompletionStreamResponse``, ``CompletionResponse``, ``EmbeddingResponse``), the same
bodies ``atomr serve`` returns. Errors raise atomr's typed errors (``InvalidRequest`` for
vLLM's 400s, naming the field).

The client holds its own ``Router`` (cached routing table, power-of-two choices), so requests
go from this process to a replica without passing through the manager or an HTTP server. The
async methods run on the caller's event loop; the sync ones on a private loop thread. Leaving
a stream early (``break``, an exception, Ctrl-C) or a sync call (Ctrl-C) aborts the request in
the engine. ``close()`` (or ``with Client() as client:``) ends the requests still open with
``RouterClosed`` and stops the thread; a client dropped without it stops its thread when collected.

The first typed request freezes the process's heap (``gc.freeze()``, once): what exists then,
vLLM and torch included, is never walked by CPython's collector again, and cyclic garbage among
it is not collected. ``ATOMR_PROCESS_TUNING=0`` in the environment leaves the collector alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib
import json
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from atomr_infer.client_loops import cancel_all, close_router_soon, close_stream, each_within, stop_soon
from atomr_infer.errors import AtomrError, EngineError, InvalidRequest, RequestError, RouterClosed
from atomr_infer.routing.manager_link import ManagerLink
from atomr_infer.routing.router import Router
from atomr_infer.serving_process import freeze_heap, tuning_wanted
from atomr_infer.wire import HttpHead, HttpRequest, RoutingFacts

_JSON = (("content-type", "application/json"),)


@dataclass(frozen=True)
class _Endpoint:
    path: str
    request: str  # vLLM's request model, "module:Class"
    response: str
    chunk: str | None  # the streamed chunk model, if the endpoint streams

    def model(self, which: str) -> Any:
        module, _, cls = getattr(self, which).partition(":")
        if module not in sys.modules:
            # First imported on a thread of its own: vLLM keeps an import error (no torchcodec) in
            # a module global, whose traceback holds the importing frames, the Client among them.
            with ThreadPoolExecutor(1) as pool:
                pool.submit(importlib.import_module, module).result()
        model = getattr(importlib.import_module(module), cls)
        _freeze_vllm_heap()
        return model


_heap_frozen = False


def _freeze_vllm_heap() -> None:
    """Once per process, after vLLM's types are first loaded: freeze the heap (as ``vllm serve``
    does once started). Importing vLLM (and torch with it) leaves ~600k objects in the caller's
    process, and streaming allocates per chunk, so CPython's full collections came often and
    walked them all: at 1,024 streams 8 collections in 11 s, 0.34 s each with the event loop
    stopped (scripts/bench_dataplane.py, client arm). Frozen, they are never walked again."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        if tuning_wanted():
            freeze_heap()


_CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
_COMPLETION = "vllm.entrypoints.openai.completion.protocol"
_EMBED = "vllm.entrypoints.pooling.embed.protocol"
CHAT = _Endpoint("/v1/chat/completions", f"{_CHAT}:ChatCompletionRequest", f"{_CHAT}:ChatCompletionResponse",
                 f"{_CHAT}:ChatCompletionStreamResponse")
COMPLETION = _Endpoint("/v1/completions", f"{_COMPLETION}:CompletionRequest", f"{_COMPLETION}:CompletionResponse",
                       f"{_COMPLETION}:CompletionStreamResponse")
EMBEDDING = _Endpoint("/v1/embeddings", f"{_EMBED}:EmbeddingCompletionRequest", f"{_EMBED}:EmbeddingResponse", None)


def _request(
    endpoint: _Endpoint, name: str, fields: dict[str, Any], check: bool = True
) -> tuple[RoutingFacts, HttpRequest]:
    """The routing facts and the request, after checking every field name (openai's ``extra_body``
    unpacked among them) against vLLM's request model; the facts come from the fields, no body."""
    fields = {**{k: v for k, v in fields.items() if k != "extra_body"}, **(fields.get("extra_body") or {})}
    known = set(endpoint.model("request").model_fields) if check else set(fields)
    for key in fields:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{endpoint.path}: unknown request field {key!r}{hint}")
    if "model" in fields:  # the first argument names it: the two could disagree
        raise TypeError(f"{endpoint.path}: model={fields['model']!r}: name the deployment (or alias, or "
                        "'deployment:adapter') as the first argument instead")
    data, converted = {"model": name, **fields}, []
    try:
        body = json.dumps(data, default=lambda value: converted.append(value) or _jsonable(value)).encode()
    except (TypeError, ValueError) as exc:
        bad = next((k for k, v in fields.items() if not _dumps_ok(v)), "request")
        raise InvalidRequest(bad, f"not JSON-serialisable: {exc}") from None
    if converted:  # a model object among the fields: routing reads the plain data the replica gets
        data = json.loads(body)
    return RoutingFacts.of(endpoint.path, data), HttpRequest("POST", endpoint.path, _JSON, body)


def _jsonable(value: Any) -> Any:
    """pydantic models (vLLM's or openai's types, e.g. a reply's message) as their JSON data."""
    if callable(dump := getattr(value, "model_dump", None)):
        return dump(mode="json", exclude_none=True)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _dumps_ok(value: Any) -> bool:
    with contextlib.suppress(TypeError, ValueError):
        return bool(json.dumps(value, default=_jsonable))
    return False


def _error(status: int, body: bytes) -> AtomrError:
    """vLLM's error response as atomr's typed error."""
    try:
        info = json.loads(body)["error"]
        message, param = str(info.get("message")), info.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode(errors="replace")[:500], None
    if status in (400, 422):
        return InvalidRequest(param or "request", message)
    if status < 500:
        return RequestError(f"HTTP {status}: {message}")
    return EngineError(f"HTTP {status}: {message}")


class Client:
    def __init__(self, address: str | None = None, manager: Any = None, wait_for_replica_s: float = 30.0) -> None:
        from atomr_infer.control.client import manager_handle as get_manager

        # Joins a running cluster and manager: a client of no deployment starts neither.
        handle = manager if manager is not None else get_manager(address, start=False)
        self._link = ManagerLink(handle, wait_for_replica_s)
        self._wait_s = wait_for_replica_s
        # one per event loop (asyncio objects are loop-bound), keyed by the loop itself (an id
        # is reused once a loop is freed); routers of closed loops are dropped.
        self._routers: dict[asyncio.AbstractEventLoop, Router] = {}
        self._closers: dict[asyncio.AbstractEventLoop, weakref.finalize] = {}  # close_router_soon, at GC
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.RLock()  # reentrant: a stream collected (its finally) while this thread holds it

    def _router(self) -> Router:
        if self._closed:
            raise RouterClosed("the Client was closed")
        key = asyncio.get_running_loop()
        for loop in [loop for loop in list(self._routers) if loop.is_closed()]:  # (other threads add theirs)
            self._drop_router(loop)
        if (router := self._routers.get(key)) is None:
            router = self._routers[key] = Router(self._link.table, wait_for_replica_s=self._wait_s,
                                                 demand=self._link.demand)
            if key is not self._loop:  # a caller's loop: its channels close once the Client is dropped
                self._closers[key] = weakref.finalize(self, close_router_soon, key, router)
        return router

    def _drop_router(self, loop: asyncio.AbstractEventLoop) -> Router | None:
        """Forget ``loop``'s router, and its closing at GC (which would hold the loop and router)."""
        closer = self._closers.pop(loop, None)
        if closer is not None:
            closer.detach()
        return self._routers.pop(loop, None)

    # -- async -------------------------------------------------------------------------------

    async def _send(self, endpoint: _Endpoint, name: str, fields: dict[str, Any]) -> Any:
        if fields.get("stream"):
            raise TypeError(f"{endpoint.path}: stream=True: use the stream_* (astream_*) methods to stream")
        timeout = fields.pop("timeout", None)  # seconds for the whole answer, as openai's; not a request field
        facts, request = _request(endpoint, name, fields)

        async def answer() -> tuple[HttpHead, bytes]:
            async with contextlib.aclosing(self._router().stream(facts, request)) as items:
                head: HttpHead = await anext(items)
                return head, b"".join([piece async for piece in items])

        scope = asyncio.timeout(timeout)  # (None: none) one that expires cancels the request: aborted in the engine
        try:
            async with scope:
                head, body = await answer()
        except TimeoutError:
            if not scope.expired():  # the request's own TimeoutError, not this limit
                raise
            raise TimeoutError(f"{endpoint.path}: no answer from {name!r} within timeout={timeout:g}s") from None
        if head.status != 200:
            raise _error(head.status, body)
        return endpoint.model("response").model_validate_json(body)

    async def _stream(
        self, endpoint: _Endpoint, name: str, fields: dict[str, Any], typed: bool = True
    ) -> AsyncIterator[Any]:
        fields = dict(fields)
        timeout = fields.pop("timeout", None)  # seconds to wait for each piece, as openai's read timeout
        facts, request = _request(endpoint, name, {**fields, "stream": True}, check=typed)
        chunk_model = endpoint.model("chunk") if typed else None
        async with contextlib.aclosing(self._router().stream(facts, request)) as routed:
            items = routed if timeout is None else each_within(routed, timeout, f"{endpoint.path}: {name!r}")
            head: HttpHead = await anext(items)
            if head.status != 200:
                raise _error(head.status, b"".join([piece async for piece in items]))
            pending = b""
            async for piece in items:
                pending += piece
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    data = event.removeprefix(b"data: ").strip()
                    if data == b"[DONE]":
                        # Read on to the end, which follows at once: leaving here would cancel
                        # on the replica a request that has finished (a Ray call each). The
                        # answer is whole: a failure after it (the replica died) is not the caller's.
                        with contextlib.suppress(Exception):
                            async for _ in items:
                                pass
                        return
                    if data.startswith(b'{"error"'):  # vLLM's in-band error after the stream started
                        raise _error(int(json.loads(data)["error"].get("code") or 500), data)
                    # Parsed in one pass (pydantic's own JSON parser): per token, this is the cost.
                    yield chunk_model.model_validate_json(data) if chunk_model is not None else json.loads(data)

    async def achat(self, name: str, messages: list[dict[str, Any]], **fields: Any) -> Any:
        """vLLM's ``ChatCompletionResponse`` for ``messages``."""
        return await self._send(CHAT, name, {"messages": messages, **fields})

    async def astream_chat(self, name: str, messages: list[dict[str, Any]], **fields: Any) -> AsyncIterator[Any]:
        """vLLM's ``ChatCompletionStreamResponse`` chunks, as the engine produces them."""
        async for chunk in self._stream(CHAT, name, {"messages": messages, **fields}):
            yield chunk

    async def astream_chat_events(
        self, name: str, messages: list[dict[str, Any]], **fields: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The same chunks as plain JSON dicts, fields unchecked: for light callers (``atomr
        chat``) that should not import vLLM (seconds, on a small machine) to print text."""
        async for chunk in self._stream(CHAT, name, {"messages": messages, **fields}, typed=False):
            yield chunk

    async def acomplete(self, name: str, prompt: str | list[str], **fields: Any) -> Any:
        """vLLM's ``CompletionResponse`` for ``prompt`` (a string, or several)."""
        return await self._send(COMPLETION, name, {"prompt": prompt, **fields})

    async def astream_complete(self, name: str, prompt: str | list[str], **fields: Any) -> AsyncIterator[Any]:
        async for chunk in self._stream(COMPLETION, name, {"prompt": prompt, **fields}):
            yield chunk

    async def aembed(self, name: str, input: str | list[str], **fields: Any) -> Any:  # noqa: A002 - OpenAI's name
        """vLLM's ``EmbeddingResponse`` (a deployment with ``runtime_config.runner: pooling``)."""
        if (fmt := {**fields, **(fields.get("extra_body") or {})}.get("encoding_format")) in ("bytes", "bytes_only"):
            raise InvalidRequest("encoding_format", f"{fmt!r} is raw bytes; embed() gives vectors ('float', 'base64')")
        return await self._send(EMBEDDING, name, {"input": input, **fields})

    # -- sync --------------------------------------------------------------------------------

    def _run(self, coro: Any) -> Future[Any]:
        with self._lock:
            if self._closed:
                coro.close()
                raise RouterClosed("the Client was closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="atomr-client", daemon=True)
                self._thread.start()
                weakref.finalize(self, stop_soon, self._loop)  # dropped without close(): its thread ends
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Any) -> Any:
        """``coro``'s result; Ctrl-C (or any exit) cancels it on the loop, which aborts the request."""
        future = self._run(coro)
        try:
            return future.result()
        except FutureCancelled:
            raise RouterClosed("the Client was closed under this request") from None
        except BaseException:
            future.cancel()
            raise

    def chat(self, name: str, messages: list[dict[str, Any]], **fields: Any) -> Any:
        return self._call(self.achat(name, messages, **fields))

    def complete(self, name: str, prompt: str | list[str], **fields: Any) -> Any:
        return self._call(self.acomplete(name, prompt, **fields))

    def embed(self, name: str, input: str | list[str], **fields: Any) -> Any:  # noqa: A002
        return self._call(self.aembed(name, input, **fields))

    def stream_chat(self, name: str, messages: list[dict[str, Any]], **fields: Any) -> Iterator[Any]:
        return self._sync(self.astream_chat(name, messages, **fields))

    def stream_complete(self, name: str, prompt: str | list[str], **fields: Any) -> Iterator[Any]:
        return self._sync(self.astream_complete(name, prompt, **fields))

    def _sync(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        step: list[asyncio.Task[Any] | None] = [None]  # the loop's task waiting for the next chunk

        async def next_chunk() -> Any:
            step[0] = asyncio.current_task()
            return await agen.__anext__()

        try:
            while True:
                try:
                    yield self._call(next_chunk())
                except StopAsyncIteration:
                    return
        finally:
            # Runs on break, errors and KeyboardInterrupt (also while a chunk is awaited: the
            # wait is cancelled first, as a generator still running cannot be closed): closing
            # the async generator makes the router cancel the replica's, which aborts the request.
            # Under the lock: a close() on another thread stops the loop only after what is queued
            # here (it may cancel it: closed all the same); closed before, close() cancelled it.
            with self._lock:
                loop = None if self._closed else self._loop
                closing = None if loop is None else asyncio.run_coroutine_threadsafe(close_stream(agen, step), loop)
            if closing is not None and threading.current_thread() is not self._thread:  # not from itself (GC)
                with contextlib.suppress(FutureCancelled):
                    closing.result(timeout=10)

    async def aclose(self) -> None:
        """Close the router of the running event loop (its channels to the replicas)."""
        router = self._drop_router(asyncio.get_running_loop())
        if router is not None:
            await router.aclose()

    def close(self) -> None:
        """End every request of the sync API (``RouterClosed``), stop its thread, and refuse
        further calls. Routers on other loops are closed with ``await aclose()`` on that loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread, self._loop = self._loop, self._thread, None
        for other, router in list(self._routers.items()):  # the async API's, on the callers' loops
            if other is not loop and not other.is_closed():
                self._drop_router(other)
                close_router_soon(other, router)
        if loop is None:
            return

        async def shutdown() -> None:
            router = self._routers.pop(loop, None)
            if router is not None:
                await router.aclose()
            await cancel_all()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)
            loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
        self.close()

