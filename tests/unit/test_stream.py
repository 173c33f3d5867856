"""Per-request streams: bounded by merging, one item per step, errors after pending output."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.errors import EngineError
from atomr_infer.replica.request import Chunk, Usage
from atomr_infer.replica.stream import RequestStream


def collect(stream: RequestStream):
    async def run():
        return [c async for c in stream]

    return run()


def test_lagging_consumer_gets_merged_deltas():
    async def main():
        s = RequestStream("r", prompt_tokens=4)
        s.put(Chunk("Hel", [1]))
        s.put(Chunk("lo", [2]))
        s.put(Chunk(" there", [3], "stop", Usage(4, 3)))
        return await collect(s)

    chunks = asyncio.run(main())
    assert len(chunks) == 1
    assert chunks[0].text_delta == "Hello there"
    assert chunks[0].token_ids == [1, 2, 3]
    assert chunks[0].finish_reason == "stop"
    assert chunks[0].usage == Usage(4, 3)


def test_prompt_consumer_gets_each_step_separately():
    async def main():
        s = RequestStream("r", prompt_tokens=1)
        got = []

        async def consume():
            async for c in s:
                got.append(c.text_delta)

        task = asyncio.create_task(consume())
        for piece, fin in (("a", None), ("b", None), ("c", "length")):
            s.put(Chunk(piece, [0], fin))
            await asyncio.sleep(0)  # let the consumer run, as a real step would
            await asyncio.sleep(0)
        await task
        return got, s

    got, s = asyncio.run(main())
    assert got == ["a", "b", "c"]
    assert s.completion_tokens == 3 and s.finished


def test_error_is_raised_after_pending_output():
    async def main():
        s = RequestStream("r", prompt_tokens=1)
        s.put(Chunk("partial", [5]))
        s.fail(EngineError("engine died"))
        got = []
        with pytest.raises(EngineError, match="engine died"):
            async for c in s:
                got.append(c.text_delta)
        return got

    assert asyncio.run(main()) == ["partial"]


def test_nothing_is_accepted_after_the_end():
    async def main():
        s = RequestStream("r", prompt_tokens=1)
        s.put(Chunk("x", [1], "stop"))
        s.put(Chunk("late", [2]))
        s.fail(EngineError("late error"))
        return await collect(s)

    chunks = asyncio.run(main())
    assert [c.text_delta for c in chunks] == ["x"]
