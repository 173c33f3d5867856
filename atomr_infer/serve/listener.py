"""The API's HTTP listener: uvicorn inside each ingress replica, on the API's own address.

Serve's proxy is not in the path. Through it, every request and every SSE chunk crossed one
more process (proxy → ingress, one Ray object per chunk): measured with
``scripts/bench_http.py`` on a 2-core EPYC, TTFT p50 at c=1 was +7 to +18 ms over ``vllm
serve``'s, and with the ingress serving HTTP itself +0.7 ms (docs/performance.md). Serve's own
way to do that (``RAY_SERVE_ENABLE_DIRECT_INGRESS``) must be in the Ray head's environment when
it starts, gives each replica a port of its own, and holds every ingress replica 35 s when it
stops; here the ingress replicas of one API share its one port (``SO_REUSEPORT``: the kernel
spreads connections over them), on the node ``run_server`` ran on, so ``host:port`` means what
the user typed. Serve still starts, health-checks, restarts and updates the ingress replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from atomr_infer.errors import AtomrError, SettingError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # as `vllm serve` reads it: seconds an idle connection stays open
CLEANUP_S = 5.0  # how long a request cancelled at the end of a stop's grace gets to clean up
# What to change when the address cannot be bound, by the reason.
_BIND_HINTS = {
    errno.EADDRINUSE: "pick another --port",
    errno.EADDRNOTAVAIL: "--host must be an address of this machine",
    errno.EACCES: "ports below 1024 need root",
}


def bind(host: str, port: int, *, shared: bool = True) -> socket.socket:
    """A listening-ready TCP socket on ``host:port``; ``shared``: with ``SO_REUSEPORT``, so that
    every ingress replica of the API (and its replacement during an update) binds it too.
    ``AtomrError`` naming the address, the reason and what to change, if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = _BIND_HINTS.get(exc.errno)
        raise AtomrError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                         + (f" (hint: {hint})" if hint else "")) from None
    return sock


def listen(host: str, port: int) -> socket.socket:
    """``bind``, shared, and listening: connections queue in the backlog until uvicorn accepts."""
    sock = bind(host, port)
    sock.listen(2048)
    return sock


def keep_alive_s() -> int:
    """``$VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (default 5), ``SettingError`` unless whole seconds."""
    value = os.environ.get(KEEP_ALIVE_ENV, "").strip() or "5"
    if not value.isdigit():
        raise SettingError(f"{KEEP_ALIVE_ENV} is {value!r}: set it to whole seconds (0 or more), or unset it for 5")
    return int(value)


def http_parser() -> str:
    """The HTTP implementation uvicorn's ``http="auto"`` picks here: httptools where it imports
    (uvicorn[standard], which Ray Serve and vLLM require, brings it), else h11, with which the
    ingress spends about a third more CPU per streamed token (docs/performance.md)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol.__module__.rsplit(".", 1)[-1].removesuffix("_impl")


def check_free(host: str, port: int) -> None:
    """Raise ``AtomrError`` unless ``host:port`` is free on this node (nothing else listens there)."""
    bind(host, port, shared=False).close()


def cancel_on_hang_up(app: ASGIApp) -> ASGIApp:
    """Cancel a request's handler when its client hangs up before the response is complete.

    Serve's proxy did this; uvicorn alone does not for a response that is not streamed, so the
    engine would compute a whole answer for nobody. Once the app has read the body (every
    forwarded route does; reading it here first would hold a whole body before the ingress's
    size check), a watcher waits on ``receive``, which then returns only ``http.disconnect``,
    and cancels the handler; its cancellation closes the router's stream, which aborts the
    request in the engine."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        body_read = asyncio.Event()
        state = {"complete": False}

        async def receive_body() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_read.set()
            return message

        async def send_tracked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        async def watch(handler: asyncio.Task[None]) -> None:
            await body_read.wait()
            message = await receive()
            if message["type"] == "http.disconnect" and not state["complete"]:
                handler.cancel()

        handler = asyncio.ensure_future(app(scope, receive_body, send_tracked))
        watcher = asyncio.ensure_future(watch(handler))
        try:
            await asyncio.wait({handler})
        finally:
            watcher.cancel()
            if not handler.done():  # this task was cancelled (the server stops): so is the handler
                handler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
        if not handler.cancelled():
            handler.result()  # the app's own error, for uvicorn to log and answer 500

    return wrapped


def direct_posts(app: ASGIApp, paths: Iterable[str], handler: Callable[[Any], Awaitable[Any]],
                 on_error: Callable[[Exception, str], Any]) -> ASGIApp:
    """``app``, but a POST to one of ``paths`` goes straight to ``handler(request)`` (a Starlette
    request; it returns a Starlette response), which the app's route for it would call anyway.

    The app's way there cost the ingress CPU it spends on no request's answer: its two
    middlewares, a match against each of its ~80 routes in turn, and the dependency Serve's
    class-based views add to give the handler ``self``. ``on_error(exc, path)`` answers, and logs,
    an exception the handler raises (the ingress's ``error_response`` logs an unexpected one with
    its traceback; through the app, Starlette answered a plain-text 500 and logged nothing)."""
    from starlette.requests import ClientDisconnect, Request

    hot = frozenset(paths)

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in hot or scope.get("root_path"):
            await app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except ClientDisconnect:  # gone while it sent its body: nobody to answer
            return
        except Exception as exc:  # noqa: BLE001 - answered (and logged) as the API answers any failure
            response = on_error(exc, scope["path"])
        await response(scope, receive, send)

    return dispatch


class HttpListener:
    """uvicorn serving ``app`` on a bound socket, in the running event loop."""

    def __init__(self, app: ASGIApp, sock: socket.socket, keep_alive_s: int = 5) -> None:
        """No cap on open requests here (as ``vllm serve``): admission is the replicas'
        (``serving.max_concurrent``, ``on_capacity_exhausted``) and the API keys' rate limits;
        uvicorn's ``limit_concurrency`` would answer 503 to the 1,025th open stream.
        ``keep_alive_s``: how long an idle connection stays open (``keep_alive_s()``)."""
        import uvicorn

        # Our access log (serve/access_log.py) and errors go through structlog; uvicorn's own
        # error logger would repeat them.
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        self._sock = sock
        self._server = uvicorn.Server(uvicorn.Config(
            cancel_on_hang_up(app), lifespan="off", access_log=False, log_config=None,
            timeout_keep_alive=keep_alive_s,
        ))
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign] # not the main thread
        self._task: asyncio.Task[None] | None = None

    def start(self, ready: Callable[[], bool] = lambda: True) -> None:
        """Start serving once ``ready()`` (polled); connections wait in the listening socket's
        backlog until then."""
        self._task = asyncio.get_running_loop().create_task(self._serve(ready))

    async def _serve(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await asyncio.sleep(0.05)
        await self._server.serve(sockets=[self._sock])

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let open requests finish for up to ``timeout_s``, then cancel those
        still open (their client gets a 500, or a stream cut short) and close."""
        if self._task is None:
            self._sock.close()
            return
        # uvicorn cancels the request tasks still open at the grace; unset, it waits for them
        # without end, and cancelling only its own task left them running: the engine went on
        # generating for a client whose connection was reset.
        self._server.config.timeout_graceful_shutdown = timeout_s
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s + CLEANUP_S)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        finally:
            # uvicorn does not wait for the tasks it cancelled: their cleanup (the router's
            # finally, which aborts the request in the replica) must run before the caller
            # closes the router.
            cancelled = set(self._server.server_state.tasks)
            if cancelled:
                await asyncio.wait(cancelled, timeout=CLEANUP_S)
            self._sock.close()
