"""A ``Client``'s life and its callers' inputs (no Ray: the replica is a fake of its channel
methods over the real ``ChannelHub``): ``close()`` ends what waits, Ctrl-C aborts, a dropped
client's thread ends, and inputs an OpenAI user passes get a clear error or just work."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import threading
import time

import pytest

from atomr_infer.client import CHAT, Client, _request
from atomr_infer.errors import InvalidRequest, RouterClosed
from atomr_infer.wire import HttpHead

from .fakes import FakeManager, FakeReplica
from .test_router_refresh import SlowSource

MESSAGES = [{"role": "user", "content": "x"}]
REPLY = {"id": "c1", "object": "chat.completion", "created": 0, "model": "d",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class ChatReplica(FakeReplica):
    """Answers a chat request as vLLM does, or never (``hang``: a long generation); records
    the bodies it was sent and the cancels."""

    def __init__(self, hang: bool = False) -> None:
        super().__init__("r0")
        self.hang, self.bodies, self.cancelled = hang, [], 0

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.bodies.append(json.loads(request.body))
        put(HttpHead(200, (("content-type", "application/json"),)))
        if self.hang:
            await asyncio.Event().wait()
        put(json.dumps(REPLY).encode())

    async def _cancel(self, channel_id, request_ids):
        self.cancelled += len(request_ids)
        await super()._cancel(channel_id, request_ids)


def client_of(replica: ChatReplica | None, **kw) -> Client:
    CHAT.model("request")  # vLLM's types imported before any timing below
    return Client(manager=FakeManager(SlowSource(replica, delay_s=0.0)), **kw)


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "atomr-client"]


def test_close_ends_a_call_waiting_in_another_thread_and_refuses_later_ones():
    """Before, the waiting caller blocked forever, and a later call started a new thread."""
    client = client_of(None, wait_for_replica_s=30)  # no replica: the call waits for one
    outcome: list[BaseException] = []

    def caller():
        try:
            client.chat("d", MESSAGES)
        except BaseException as exc:  # noqa: BLE001 - what the caller gets is the point
            outcome.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.5)
    client.close()
    thread.join(10)
    assert not thread.is_alive() and isinstance(outcome[0], RouterClosed), outcome
    with pytest.raises(RouterClosed):
        client.chat("d", MESSAGES)
    assert not client_threads()


def test_ctrl_c_in_a_sync_call_aborts_the_request_on_the_replica():
    replica = ChatReplica(hang=True)
    client = client_of(replica)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            client.chat("d", MESSAGES)
    finally:
        signal.signal(signal.SIGALRM, previous)
    deadline = time.monotonic() + 5
    while replica.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replica.cancelled == 1 and replica.hub.open_requests == 0
    client.close()


def test_a_client_closes_as_a_context_manager_and_a_dropped_one_ends_its_thread():
    with client_of(ChatReplica()) as client:
        assert client.chat("d", MESSAGES).choices[0].message.content == "hi"
    assert not client_threads()
    dropped = client_of(ChatReplica())
    dropped.chat("d", MESSAGES)
    del dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while client_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client_threads()


def test_one_router_per_live_event_loop():
    """``asyncio.run`` per call made a router each, never dropped."""
    client = client_of(ChatReplica())
    for _ in range(3):
        assert asyncio.run(client.achat("d", MESSAGES)).choices[0].message.content == "hi"
    assert len(client._routers) == 1  # the last loop's: the others were closed, and dropped
    assert len(client._closers) == 1  # with what closes them at GC, which held each loop and router


def test_inputs_an_openai_user_passes():
    replica = ChatReplica()
    client = client_of(replica)
    reply = client.chat("d", MESSAGES)
    # The reply's message object back in the history (openai's multi-turn idiom): sent as JSON.
    client.chat("d", [*MESSAGES, reply.choices[0].message, {"role": "user", "content": "more"}])
    assert replica.bodies[-1]["messages"][1] == {"role": "assistant", "content": "hi"}
    facts, _ = _request(CHAT, "d", {"messages": [*MESSAGES, reply.choices[0].message]})
    assert facts.prompt[1] == {"role": "assistant", "content": "hi"}  # prefix routing reads it as the replica does
    with pytest.raises(TypeError, match="model='other': name the deployment"):
        client.chat("d", MESSAGES, model="other")  # it silently went to 'other'
    with pytest.raises(TypeError, match="stream=True: use the stream_"):
        client.chat("d", MESSAGES, stream=True)  # the event stream was parsed as one JSON body
    with pytest.raises(InvalidRequest, match="stop: not JSON-serialisable"):
        client.chat("d", MESSAGES, stop={"x"})
    facts, request = _request(CHAT, "d", {"messages": MESSAGES, "extra_body": {"top_k": 5}})  # openai's idiom
    assert json.loads(request.body)["top_k"] == 5 and "extra_body" not in json.loads(request.body)
    with pytest.raises(InvalidRequest, match="encoding_format: 'bytes' is raw bytes"):
        client.embed("d", "x", encoding_format="bytes")  # a pydantic ValidationError of the bytes, after the engine ran
    with pytest.raises(InvalidRequest, match="encoding_format: 'bytes_only' is raw bytes"):
        client.embed("d", "x", extra_body={"encoding_format": "bytes_only"})
    assert len(replica.bodies) == 2  # none of the refused was sent
    client.close()


def test_a_timeout_ends_the_call_and_aborts_its_request():
    """openai's ``timeout=`` (or Ray Serve's ``result(timeout_s=)``): it was an unknown field."""
    replica = ChatReplica(hang=True)
    client = client_of(replica)
    with pytest.raises(TimeoutError, match="no answer from 'd' within timeout=0.3s"):
        client.chat("d", MESSAGES, timeout=0.3)
    deadline = time.monotonic() + 5
    while replica.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replica.cancelled == 1 and "timeout" not in replica.bodies[0]
    client.close()


class StreamReplica(ChatReplica):
    """Streams two chunks a little apart, then ``[DONE]``; or hangs after its first (``hang``)."""

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.bodies.append(json.loads(request.body))
        put(HttpHead(200, (("content-type", "text/event-stream"),)))
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "d",
                 "choices": [{"index": 0, "delta": {"content": "hi"}}]}
        for _ in range(2):
            put(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.1)
            if self.hang:
                await asyncio.Event().wait()
        put(b"data: [DONE]\n\n")


def test_a_stream_timeout_bounds_the_wait_for_each_piece_and_aborts_its_request():
    """openai's ``timeout=`` on a stream (its read timeout): it was refused as an unknown field."""
    client = client_of(StreamReplica())
    assert [c.choices[0].delta.content for c in client.stream_chat("d", MESSAGES, timeout=5)] == ["hi", "hi"]
    client.close()
    replica = StreamReplica(hang=True)
    client = client_of(replica)
    got = []
    with pytest.raises(TimeoutError, match="nothing came within timeout=0.5s"):
        for chunk in client.stream_chat("d", MESSAGES, timeout=0.5):
            got.append(chunk)
    assert len(got) == 1  # the stream had begun: the limit is per piece, not for the whole
    deadline = time.monotonic() + 5
    while replica.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replica.cancelled == 1 and "timeout" not in replica.bodies[0]
    client.close()


def test_without_a_timeout_a_timeout_error_of_the_request_is_its_own():
    """``{None:g}`` made a request's own TimeoutError (Ray's GetTimeoutError is one) a TypeError."""

    class TimesOut(ChatReplica):
        async def _serve(self, request, put, tokens, resume=None, prefilled=None):
            raise TimeoutError("the engine took too long")

    client = client_of(TimesOut())
    for timeout in (None, 30.0):
        with pytest.raises(Exception, match="the engine took too long") as caught:
            client.chat("d", MESSAGES, **({} if timeout is None else {"timeout": timeout}))
        assert not isinstance(caught.value, TypeError)
    client.close()

