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
