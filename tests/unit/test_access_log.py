"""Reading the usage a response reports, for the access log and the per-key token metric."""

from __future__ import annotations

import json

import pytest

from atomr_infer.errors import InvalidRequest
from atomr_infer.serve.usage import body_tokens, refuse_uncounted, usage_tokens
from atomr_infer.wire import RequestKind, RoutingFacts

USAGE = {"prompt_tokens": 30, "completion_tokens": 11, "total_tokens": 41}


def test_a_json_body_reports_its_total_tokens() -> None:
    body = json.dumps({"id": "x", "choices": [], "usage": USAGE}).encode()
    assert usage_tokens(body) == 41


def test_a_stream_reports_the_usage_of_its_usage_event() -> None:
    chunk = {"choices": [], "usage": None}
    events = [b"data: " + json.dumps(chunk).encode(), b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode()]
    assert usage_tokens(b"\n\n".join([*events, b"data: [DONE]"]) + b"\n\n", sse=True) == 41


def test_no_usage_or_an_unreadable_one_is_none() -> None:
    assert usage_tokens(b'data: {"choices": []}\n\n', sse=True) is None
    assert usage_tokens(b'data: {"usage": {"total_tokens": "many"}}\n\n', sse=True) is None
    assert usage_tokens(b'{"usage": ') is None
    assert usage_tokens(b"data: {\"usage\": null}\n\n", sse=True) is None


def test_a_stream_that_did_not_ask_for_usage_gets_it_hidden_again() -> None:
    import asyncio

    from atomr_infer.serve.usage import without_usage
    from atomr_infer.wire import LastBytes, RoutingFacts

    def usage_not_asked(body):
        return not RoutingFacts.of("/v1/chat/completions", {"model": "m", **body}).usage_wanted

    assert usage_not_asked({"stream": True}) and usage_not_asked({"stream": True, "stream_options": {}})
    assert not usage_not_asked({"stream": True, "stream_options": {"include_usage": True}})
    assert not usage_not_asked({"stream": False}) and not usage_not_asked({"stream": True, "stream_options": 3})
    text = b'data: {"choices": [{"delta": {"content": "Hi"}}], "usage": null}\n\n'
    usage = b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n"
    chunks = [text, LastBytes(usage + b"data: [DONE]\n\n")]  # the router marks the last (routing/channel.py)

    async def read() -> list[bytes]:
        async def source():
            for c in chunks:
                yield c

        return [c async for c in without_usage(source())]

    got = asyncio.run(read())
    assert b"".join(got) == text + b"data: [DONE]\n\n"
    assert type(got[-1]) is LastBytes  # still ends the HTTP response (serve/answers.py SSEResponse)


def test_responses_and_messages_report_their_usage() -> None:
    completed = {"type": "response.completed", "response": {"usage": {"input_tokens": 9, "output_tokens": 5,
                                                                      "total_tokens": 14}}}
    assert usage_tokens(b"event: response.completed\ndata: " + json.dumps(completed).encode() + b"\n\n", sse=True) == 14
    delta = {"type": "message_delta", "usage": {"input_tokens": 9, "output_tokens": 7, "cache_read_input_tokens": 2}}
    assert usage_tokens(b"event: message_delta\ndata: " + json.dumps(delta).encode() + b"\n\n", sse=True) == 18
    assert usage_tokens(json.dumps({"type": "message", "usage": {"input_tokens": 3, "output_tokens": 4}}).encode()) == 7


def test_text_that_says_data_colon_does_not_hide_the_usage() -> None:
    """A body or an event whose text held "data: " (a chat answer, a Responses event's output):
    it was read as an SSE prefix, the JSON cut there, and the request charged nothing."""
    said = "The metadata: x, and data: y"
    body = json.dumps({"choices": [{"message": {"content": said}}], "usage": USAGE}).encode()
    assert usage_tokens(body) == 41
    completed = {"type": "response.completed", "response": {"output": [{"text": said}], "usage": USAGE}}
    assert usage_tokens(b"event: response.completed\ndata: " + json.dumps(completed).encode() + b"\n\n", sse=True) == 41


EMBED = RoutingFacts("m", RequestKind.OTHER)


def test_pooling_answers_without_a_usage_field_are_counted() -> None:
    """Cohere's /v2/embed bills in meta.billed_units; embeddings as bytes carry their usage in a
    metadata header (vLLM's pooling/utils.py). Both were charged nothing."""
    cohere = {"id": "x", "embeddings": {"float": [[0.1]]}, "meta": {"api_version": {"version": "2"},
                                                                   "billed_units": {"input_tokens": 7}}}
    assert usage_tokens(json.dumps(cohere).encode()) == 7
    metadata = json.dumps({"id": "x", "data": [], "usage": {"prompt_tokens": 5, "total_tokens": 5}})
    assert body_tokens(b"\x00\x01binary", {"content-type": "application/octet-stream", "metadata": metadata}) == 5
    assert body_tokens(json.dumps({"usage": USAGE}).encode(), {"content-type": "application/json"}) == 41
    with pytest.raises(InvalidRequest, match="encoding_format: 'bytes_only' answers carry no usage"):
        refuse_uncounted({"model": "m", "input": "x", "encoding_format": "bytes_only"}, EMBED)
    refuse_uncounted({"model": "m", "input": "x", "encoding_format": "bytes"}, EMBED)  # its usage is in a header


def test_a_stream_the_client_left_before_its_usage_is_charged_an_estimate() -> None:
    """Its usage comes last: a client that left before it was charged nothing, so a token budget
    could be spent past its limit by hanging up. It is charged one token per event it was sent and
    the request body's bytes / 4 for the prompt; a stream that ran to its end, its usage or nothing."""
    import asyncio

    from atomr_infer.serve.access_log import AccessLog

    delta = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    usage = b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n"

    async def charged(chunks: list[bytes], read: int | None = None) -> list[int | None]:
        async def source():
            for chunk in chunks:
                yield chunk

        told: list[int | None] = []
        stream = AccessLog().stream(source(), "alice", "d", 200, 0.0, told.append, prompt=lambda: 100)
        if read is None:  # to its end
            _ = [chunk async for chunk in stream]
        for _ in range(read or 0):
            await anext(stream)
        await stream.aclose()
        return told

    assert asyncio.run(charged([delta, delta + delta, delta, usage, b"data: [DONE]\n\n"], 2)) == [3 + 100]
    assert asyncio.run(charged([delta, usage, b"data: [DONE]\n\n"])) == [41]
    assert asyncio.run(charged([delta, b"data: [DONE]\n\n"])) == [None]  # whole, without usage asked for


def test_the_prompt_estimate_leaves_out_media() -> None:
    """An image's data URL is megabytes: as bytes / 4 a client that left charged a key's budget
    for half an hour (a 1.5 MB image: 500,000 tokens)."""
    from atomr_infer.serve.usage import prompt_estimate

    text = {"role": "user", "content": [{"type": "text", "text": "What is in this picture? " * 4}]}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgo" * 150_000}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRi" * 100_000, "format": "wav"}}
    plain = json.dumps({"model": "d", "messages": [text]}).encode()
    with_media = json.dumps({"model": "d", "messages": [{**text, "content": [*text["content"], image, audio]}]})
    assert prompt_estimate(plain) == len(plain) // 4
    assert prompt_estimate(with_media.encode()) < 200


def test_cohere_chat_usage_is_read_and_an_answer_without_usage_is_estimated() -> None:
    """/cohere/v2/chat reports usage.tokens, as floats (a stream: in its message-end's delta);
    audio reports seconds or nothing. Both were None: charged nothing to a token budget."""
    usage = {"billed_units": {"input_tokens": 9.0, "output_tokens": 40.0}, "tokens": {"input_tokens": 9.0,
                                                                                     "output_tokens": 40.0}}
    assert usage_tokens(json.dumps({"id": "x", "usage": usage}).encode()) == 49
    end = {"type": "message-end", "id": "x", "delta": {"finish_reason": "COMPLETE", "usage": usage}}
    assert usage_tokens(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n", sse=True) == 49
    transcription = json.dumps({"text": "x" * 400, "usage": {"type": "duration", "seconds": 6}}).encode()
    assert body_tokens(transcription, {"content-type": "application/json"}) == len(transcription) // 4
    assert body_tokens(b"{}", {"content-type": "application/json"}) == 1
    assert body_tokens(b'{"error": {"message": "bad"}}', {"content-type": "application/json"}, 400) is None
