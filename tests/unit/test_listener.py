"""The ingress's own HTTP listener (serve/listener.py), with real uvicorn and a real httpx client
on loopback: a shared port, a taken port, a client that hangs up, a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from atomr_infer.errors import AtomrError
from atomr_infer.local_ray import free_port
from atomr_infer.serve.answers import SSEResponse
from atomr_infer.serve.listener import HttpListener, check_free, direct_posts, http_parser, listen
from atomr_infer.wire import LastBytes
from tests.waiting import await_until


async def slow_answer(request: Request, events: list[str], delay_s: float) -> JSONResponse:
    await request.body()  # as the ingress does: the watcher listens once the body is read
    events.append("started")
    try:
        await asyncio.sleep(delay_s)
    except asyncio.CancelledError:
        events.append("cancelled")
        raise
    events.append("finished")
    return JSONResponse({"ok": True})


def slow_app(events: list[str], delay_s: float) -> FastAPI:
    app = FastAPI()

    @app.post("/slow")
    async def slow(request: Request) -> JSONResponse:
        return await slow_answer(request, events, delay_s)

    return app


async def hang_up_on_slow(url: str, events: list[str]) -> None:
    """POST /slow, give up waiting and close the connection; the handler must see it cancelled."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/slow")
    assert await await_until(lambda: "cancelled" in events, 5.0), events


def test_replicas_share_the_port_and_a_taken_port_is_one_clear_error():
    port = free_port()
    first, second = listen("127.0.0.1", port), listen("127.0.0.1", port)  # two ingress replicas
    try:
        with pytest.raises(AtomrError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_free("127.0.0.1", port)
    finally:
        first.close()
        second.close()
    check_free("127.0.0.1", port)  # free again once they are gone


def test_a_client_that_hangs_up_cancels_a_response_that_is_not_streamed():
    events: list[str] = []

    async def run() -> None:
        port = free_port()
        listener = HttpListener(slow_app(events, 30.0), listen("127.0.0.1", port))
        listener.start()
        try:
            await hang_up_on_slow(f"http://127.0.0.1:{port}", events)
        finally:
            await listener.stop(1.0)

    asyncio.run(run())
    assert events == ["started", "cancelled"]


def test_a_request_runs_to_its_end_and_a_stop_lets_an_open_one_finish():
    events: list[str] = []

    async def run() -> None:
        port = free_port()
        listener = HttpListener(slow_app(events, 0.5), listen("127.0.0.1", port))
        listener.start()
        async with httpx.AsyncClient(timeout=10.0) as client:
            answer = await client.post(f"http://127.0.0.1:{port}/slow")
            assert (answer.status_code, answer.json()) == (200, {"ok": True})
            open_request = asyncio.ensure_future(client.post(f"http://127.0.0.1:{port}/slow"))
            assert await await_until(lambda: events.count("started") == 2, 5.0)
            await listener.stop(5.0)
            assert (await open_request).status_code == 200
        with pytest.raises(httpx.ConnectError):  # stopped: nothing listens any more
            httpx.post(f"http://127.0.0.1:{port}/slow", timeout=2.0)

    asyncio.run(run())
    assert events == ["started", "finished", "started", "finished"]


def test_a_stop_cancels_a_request_still_open_at_the_grace():
    """A request past the grace is cancelled (its finally, the router's abort in the replica,
    runs before stop() returns) and its client answered, not left to run for nobody."""
    events: list[str] = []

    async def run() -> None:
        port = free_port()
        listener = HttpListener(slow_app(events, 30.0), listen("127.0.0.1", port))
        listener.start()
        async with httpx.AsyncClient(timeout=10.0) as client:
            open_request = asyncio.ensure_future(client.post(f"http://127.0.0.1:{port}/slow"))
            assert await await_until(lambda: "started" in events, 5.0)
            started = asyncio.get_running_loop().time()
            await listener.stop(0.5)
            assert asyncio.get_running_loop().time() - started < 5.0
            assert events == ["started", "cancelled"]
            assert (await asyncio.wait_for(open_request, 5.0)).status_code == 500

    asyncio.run(run())


def test_direct_posts_reach_the_handler_and_everything_else_the_app():
    """The ingress's model requests skip the app's routing (direct_posts); the app still answers
    every other method and path, a handler's failure gets on_error's answer, and a client that
    hangs up still cancels the handler."""
    events: list[str] = []
    app = slow_app(events, 30.0)

    @app.post("/hot")
    async def through_the_app(request: Request) -> JSONResponse:
        return JSONResponse({"via": "app"})

    @app.get("/hot")
    async def hot_get(request: Request) -> JSONResponse:
        return JSONResponse({"via": "app get"})

    async def handler(request: Request) -> JSONResponse:
        if request.url.path == "/slow":
            return await slow_answer(request, events, 30.0)
        body = await request.json()
        if body.get("fail"):
            raise RuntimeError("the handler broke")
        return JSONResponse({"via": "direct", "path": request.url.path, "query": request.url.query, "body": body})

    def on_error(exc: Exception, path: str) -> JSONResponse:
        return JSONResponse({"error": f"{path}: {exc}"}, status_code=500)

    async def run() -> None:
        port = free_port()
        listener = HttpListener(direct_posts(app, ["/hot", "/slow"], handler, on_error), listen("127.0.0.1", port))
        listener.start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                direct = await client.post(f"{url}/hot?x=1", json={"a": 1})
                assert direct.json() == {"via": "direct", "path": "/hot", "query": "x=1", "body": {"a": 1}}
                assert (await client.get(f"{url}/hot")).json() == {"via": "app get"}
                assert (await client.post(f"{url}/hot/")).status_code == 307  # the app's redirect
                assert (await client.post(f"{url}/nowhere")).status_code == 404
                failed = await client.post(f"{url}/hot", json={"fail": True})
                assert (failed.status_code, failed.json()) == (500, {"error": "/hot: the handler broke"})
            await hang_up_on_slow(url, events)
        finally:
            await listener.stop(1.0)

    asyncio.run(run())
    assert events == ["started", "cancelled"]


def test_a_client_that_leaves_a_stream_closes_it():
    """SSEResponse streams in the handler's task, without Starlette's task group that waits for
    the client to leave: the listener's watcher cancels the handler, and the stream is closed
    (in the ingress, that aborts the request in the engine)."""
    events: list[str] = []

    async def ticks():
        try:
            for i in range(100_000):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)
            events.append("ran to its end")
        finally:
            events.append("closed")

    app = FastAPI()

    @app.post("/stream")
    async def stream(request: Request) -> SSEResponse:
        await request.body()
        return SSEResponse(ticks())

    async def run() -> None:
        port = free_port()
        listener = HttpListener(app, listen("127.0.0.1", port))
        listener.start()
        try:
            async with (httpx.AsyncClient(timeout=10.0) as client,
                        client.stream("POST", f"http://127.0.0.1:{port}/stream") as answer):
                assert answer.headers["content-type"].startswith("text/event-stream")
                lines = answer.aiter_lines()
                assert [await anext(lines) for _ in range(3)] == ["data: 0", "", "data: 1"]
            assert await await_until(lambda: "closed" in events, 5.0), events
        finally:
            await listener.stop(1.0)

    asyncio.run(run())
    assert events == ["closed"]


def test_a_stream_ends_for_its_client_at_its_last_bytes_before_its_bookkeeping():
    """The router's ``LastBytes`` end the HTTP response at once; what runs as the iterator stops
    after them (the router's, the access log's bookkeeping) comes after. Here that cleanup waits
    until the client holds the whole response: ending the response after it would hang. Plain
    bytes end the response when the iterator stops, as before."""
    events: list[str] = []
    release = asyncio.Event()

    async def answer(last: bytes):
        try:
            yield b"data: 1\n\n"
            yield last
        finally:
            events.append("cleanup")
            if isinstance(last, LastBytes):
                await release.wait()
            events.append("cleaned up")

    app = FastAPI()

    @app.post("/stream/{kind}")
    async def stream(kind: str, request: Request) -> SSEResponse:
        await request.body()
        done = b"data: [DONE]\n\n"
        return SSEResponse(answer(LastBytes(done) if kind == "last" else done))

    async def run() -> None:
        port = free_port()
        listener = HttpListener(app, listen("127.0.0.1", port))
        listener.start()
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                marked = await asyncio.wait_for(client.post(f"http://127.0.0.1:{port}/stream/last"), 5.0)
                assert marked.text == "data: 1\n\ndata: [DONE]\n\n"
                assert events == ["cleanup"]  # still running, with the client's response complete
                release.set()
                assert await await_until(lambda: "cleaned up" in events, 5.0), events
                plain = await client.post(f"http://127.0.0.1:{port}/stream/plain")
                assert plain.text == "data: 1\n\ndata: [DONE]\n\n"
                assert events == ["cleanup", "cleaned up", "cleanup", "cleaned up"]
        finally:
            await listener.stop(1.0)

    asyncio.run(run())


def test_streams_that_end_on_one_batch_all_end_before_any_does_its_bookkeeping():
    """A router's batch ends many streams in one turn of the loop; each ``SSEResponse`` yields
    after its ``LastBytes`` so that every one of them ends for its client before the first one's
    cleanup (the router's, the access log's) runs."""
    events: list[str] = []
    batch = asyncio.Event()

    async def answer(i: int):
        try:
            await batch.wait()
            yield LastBytes(b"data: [DONE]\n\n")
        finally:
            events.append(f"cleanup {i}")

    def sender(i: int):
        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and not message["more_body"]:
                events.append(f"end {i}")

        return send

    async def run() -> None:
        responses = [SSEResponse(answer(i)) for i in range(3)]
        tasks = [asyncio.create_task(r({"type": "http"}, None, sender(i))) for i, r in enumerate(responses)]
        await asyncio.sleep(0)
        batch.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert events == ["end 0", "end 1", "end 2", "cleanup 0", "cleanup 1", "cleanup 2"]


def test_a_str_chunk_is_sent_encoded_as_starlette_sends_it():
    sent: list[bytes] = []

    async def answer():
        yield "data: é\n\n"

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    asyncio.run(SSEResponse(answer())({"type": "http"}, None, send))
    assert sent == ["data: é\n\n".encode(), b""]


def test_http_parser_is_httptools_where_it_imports():
    try:
        import httptools  # noqa: F401
    except ImportError:
        assert http_parser() == "h11"
    else:
        assert http_parser() == "httptools"


def _taken_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_an_address_that_cannot_be_bound_gets_the_hint_for_its_reason(monkeypatch):
    """The hint said "pick another --port" for a --host of another machine too."""
    taken, port = _taken_port()
    with taken, pytest.raises(AtomrError) as info:
        check_free("127.0.0.1", port)
    assert str(info.value) == f"cannot listen on 127.0.0.1:{port}: Address already in use (hint: pick another --port)"
    with pytest.raises(AtomrError) as info:  # TEST-NET-1: an address, but none of this machine's
        check_free("192.0.2.1", 8000)
    assert str(info.value) == ("cannot listen on 192.0.2.1:8000: Cannot assign requested address "
                               "(hint: --host must be an address of this machine)")

    def refused(self, address):  # the kernel's answer to a user other than root (tests may run as root)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refused)
    with pytest.raises(AtomrError) as info:
        check_free("127.0.0.1", 80)
    assert str(info.value) == "cannot listen on 127.0.0.1:80: Permission denied (hint: ports below 1024 need root)"


def test_an_idle_connection_is_closed_after_vllms_keep_alive_setting(monkeypatch):
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE, read as `vllm serve` reads it (5 s was fixed)."""
    from atomr_infer.errors import SettingError
    from atomr_infer.serve.listener import keep_alive_s

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert keep_alive_s() == 5
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "1")
    assert keep_alive_s() == 1
    for bad in ("abc", "-1", "1.5"):
        monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", bad)
        with pytest.raises(SettingError, match=f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE is '{bad}': set it to whole seconds"):
            keep_alive_s()

    async def idle_for(keep_alive: int) -> float:
        """Seconds an idle connection stays open after its answer, up to 4.5."""
        port = free_port()
        listener = HttpListener(slow_app([], 0.0), listen("127.0.0.1", port), keep_alive)
        listener.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            await reader.readuntil(b'{"ok":true}')
            answered = asyncio.get_running_loop().time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader.read(), 4.5)  # b"" once the server closes it
            return asyncio.get_running_loop().time() - answered
        finally:
            writer.close()
            await listener.stop(1.0)

    assert asyncio.run(idle_for(1)) < 4.0  # (slack for a busy machine: 1 s, not 5)
    assert asyncio.run(idle_for(5)) >= 4.5
