"""A ``Client`` stream read to ``[DONE]`` ends without cancelling its finished request (no Ray:
the replica is a fake of its channel methods over the real ``ChannelHub``)."""

from __future__ import annotations

import asyncio

from atomr_infer.client import Client
from atomr_infer.engine.vllm.openai_app import HttpHead

from .fakes import FakeManager, FakeReplica
from .test_router_refresh import SlowSource


class SseReplica(FakeReplica):
    """Answers an ``http`` request as vLLM streams one: a head, an event, ``[DONE]``; the end of
    the request comes a moment later, in a batch of its own."""

    async def _answer(self, put):
        put(HttpHead(200, (("content-type", "text/event-stream"),)))
        put(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        put(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05)

    async def _cancel(self, channel_id, request_ids):
        self.cancelled += len(request_ids)
        await super()._cancel(channel_id, request_ids)


MESSAGES = [{"role": "user", "content": "x"}]
ANSWER = [{"choices": [{"delta": {"content": "hi"}}]}]


def client_of(replica: SseReplica) -> Client:
    replica.cancelled = 0
    return Client(manager=FakeManager(SlowSource(replica, delay_s=0.0)))


def test_a_client_stream_read_to_done_cancels_nothing_on_the_replica():
    replica = SseReplica("r0")
    client = client_of(replica)

    async def one():
        return [e async for e in client.astream_chat_events("d", MESSAGES)]

    async def main():
        return await asyncio.gather(*(one() for _ in range(20)))

    streams = asyncio.run(main())
    assert all(s == ANSWER for s in streams)
    assert replica.cancelled == 0


def test_a_client_that_leaves_mid_stream_still_cancels_its_request():
    replica = SseReplica("r0")
    client = client_of(replica)

    async def main():
        async for _ in client.astream_chat_events("d", MESSAGES):
            break  # leaves after the first event: the request has not ended
        for _ in range(1000):  # the stream is closed when collected, then the cancel is sent
            if replica.cancelled:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert replica.cancelled == 1


class FailsAfterDone(SseReplica):
    async def _answer(self, put):
        await super()._answer(put)
        raise RuntimeError("the replica failed after the answer was whole")


def test_a_failure_after_done_does_not_fail_a_whole_answer():
    replica = FailsAfterDone("r0")
    client = client_of(replica)

    async def main():
        return [e async for e in client.astream_chat_events("d", MESSAGES)]

    assert asyncio.run(main()) == ANSWER
