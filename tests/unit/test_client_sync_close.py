"""The sync ``Client`` stream closed while it waits for a chunk (Ctrl-C in ``stream_chat``):
the caller gets its ``KeyboardInterrupt``, and the async stream is cancelled and closed at once
(that is what aborts the replica's request), not when the garbage collector finds it."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from atomr_infer.client import Client


def test_ctrl_c_while_a_chunk_is_awaited_cancels_and_closes_the_stream() -> None:
    closed = threading.Event()

    async def stream():
        try:
            yield "first"
            await asyncio.Event().wait()  # the next chunk never comes
            yield "never"
        finally:
            closed.set()

    client = Client(manager=object())

    def interrupt(*_):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    chunks = client._sync(stream())
    try:
        assert next(chunks) == "first"
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # Ctrl-C while the next chunk is awaited
        with pytest.raises(KeyboardInterrupt):
            next(chunks)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert closed.wait(5), "the async stream was not closed"


def test_a_loop_that_breaks_closes_the_stream() -> None:
    closed = threading.Event()

    async def stream():
        try:
            for i in range(100):
                yield i
        finally:
            closed.set()

    for chunk in Client(manager=object())._sync(stream()):
        if chunk == 2:
            break
    assert closed.wait(5)


def test_a_stream_left_while_another_thread_closes_the_client() -> None:
    """The stream's cleanup read the client's loop, then used it: a close() on another thread in
    between made it None (a raw AttributeError where the stream was closed)."""
    closer: list[threading.Thread] = []

    class Racing(Client):
        race = False

        @property
        def _loop(self):
            loop = self.__dict__["loop"]
            if self.race and not closer:  # right after the cleanup's first read, the other thread closes
                closer.append(threading.Thread(target=self.close))
                closer[0].start()
                closer[0].join(0.5)  # (blocked on the client's lock where the cleanup holds it)
            return loop

        @_loop.setter
        def _loop(self, loop):
            self.__dict__["loop"] = loop

    async def stream():
        for i in range(100):
            yield i

    client = Racing(manager=object())
    chunks = client._sync(stream())
    for chunk in chunks:
        if chunk == 2:
            break
    client.race = True
    chunks.close()  # as leaving a `with closing(...)` or the generator's collection does
    closer[0].join(10)
    assert not closer[0].is_alive() and client._closed
