"""The HTTP edge without Ray: OpenAI request parsing, error mapping and SSE framing."""

from __future__ import annotations

import asyncio
import json

import pytest

from atomr_infer.errors import (
    CapacityExhausted,
    DeploymentNotFound,
    EngineError,
    InvalidRequest,
    NoReadyReplica,
)
from atomr_infer.replica.request import Chunk, Usage
from atomr_infer.serve.errors import ManagerUnreachable, http_error
from atomr_infer.serve.protocol import parse_chat, parse_completion, to_generate_request
from atomr_infer.serve.responses import DONE, ChatFormat, CompletionFormat, collect, sse_events

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": MESSAGES, **fields})


# -- requests --------------------------------------------------------------------------------


def test_chat_request_becomes_the_replica_request():
    req = chat(max_completion_tokens=5, temperature=0, top_p=0.5, stop="x", seed=1, user="u", ignore_eos=True)
    assert to_generate_request(req, "id-1") == {
        "request_id": "id-1",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "x",
        "seed": 1,
        "ignore_eos": True,
    }
    assert req.max_tokens_field == "max_completion_tokens"


def test_max_completion_tokens_wins_over_max_tokens():
    assert to_generate_request(chat(max_tokens=9, max_completion_tokens=3), "i")["max_tokens"] == 3


def test_text_parts_are_joined():
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert to_generate_request(req, "i")["messages"][0]["content"] == "a\nb"


def test_completion_prompt_as_a_one_element_list():
    req = parse_completion({"model": "m", "prompt": ["hello"], "max_tokens": 2})
    assert to_generate_request(req, "i") == {"request_id": "i", "prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"temperature": 3}, "temperature", "between 0 and 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"n": 3}, "n", "only n=1"),
        ({"max_tokens": 0}, "max_tokens", "positive"),
        ({"stream": "yes"}, "stream", "boolean"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"logprobs": True, "tools": []}, "logprobs", "unsupported fields 'logprobs', 'tools'"),
        ({"stream": True, "stream_options": {"chunk": 1}}, "stream_options.chunk", "unsupported"),
    ],
)
def test_bad_requests_name_the_param(fields, param, words):
    with pytest.raises(InvalidRequest) as info:
        chat(**fields)
    assert info.value.field == param
    assert words in info.value.message


def test_off_values_of_unsupported_fields_are_accepted_and_others_rejected():
    chat(frequency_penalty=0.0, presence_penalty=0, logprobs=False, logit_bias=None)
    with pytest.raises(InvalidRequest) as info:
        chat(presence_penalty=0.5)
    assert info.value.field == "presence_penalty" and "accepted only as presence_penalty=0" in info.value.message
    with pytest.raises(InvalidRequest):
        chat(logprobs=0)  # not the boolean false


def test_missing_and_malformed_inputs():
    with pytest.raises(InvalidRequest, match="model is required"):
        parse_chat({"messages": MESSAGES})
    with pytest.raises(InvalidRequest) as info:
        parse_chat({"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    assert info.value.field == "messages[0].role"
    with pytest.raises(InvalidRequest) as info:
        parse_completion({"model": "m", "prompt": ["a", "b"]})
    assert info.value.field == "prompt" and "one string" in info.value.message
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse_chat(["not", "an", "object"])


# -- errors ----------------------------------------------------------------------------------


def test_error_statuses_and_bodies():
    cases = {
        DeploymentNotFound("x", ["smollm2"]): (404, "model_not_found"),
        InvalidRequest("temperature", "bad"): (400, "invalid_value"),
        CapacityExhausted("x", 1, 2.5): (429, "capacity_exhausted"),
        NoReadyReplica("x", 3.0): (503, "no_ready_replica"),
        ManagerUnreachable("restarting"): (503, "manager_unreachable"),
        EngineError("boom"): (500, "engine_error"),
        RuntimeError("bug"): (500, "internal_error"),
    }
    for exc, (status, code) in cases.items():
        err = http_error(exc)
        assert (err.status, err.code) == (status, code), exc
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert http_error(CapacityExhausted("x", 1, 2.5)).headers == {"Retry-After": "3"}
    assert http_error(InvalidRequest("temperature", "bad")).param == "temperature"


def test_the_param_is_the_name_the_caller_used():
    exc = InvalidRequest("max_tokens", "max_tokens=4000 plus the prompt's 9 tokens exceeds the context")
    err = http_error(exc, {"max_tokens": "max_completion_tokens"})
    assert err.param == "max_completion_tokens" and err.message.startswith("max_completion_tokens=4000")


# -- responses -------------------------------------------------------------------------------


async def _chunks(*items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def _events(raw: list[bytes]) -> list:
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in raw)
    return [e[6:-2].decode() if e == DONE else json.loads(e[6:-2]) for e in raw]


async def _drain(gen) -> list[bytes]:
    return [e async for e in gen]


def test_sse_chat_stream_with_usage():
    usage = Usage(7, 2)
    chunks = _chunks(Chunk("lo", [2]), Chunk("", [], "stop", usage))
    fmt = ChatFormat("chatcmpl-1", "m", include_usage=True)
    events = _events(asyncio.run(_drain(sse_events(chunks, Chunk("Hel", [1]), fmt))))
    assert events[-1] == "[DONE]"
    first, second, last, usage_event = events[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert second["choices"][0]["delta"] == {"content": "lo"} and second["usage"] is None
    assert last["choices"][0]["finish_reason"] == "stop"
    assert usage_event["choices"] == []
    assert usage_event["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert {e["id"] for e in events[:-1]} == {"chatcmpl-1"}


def test_an_engine_failure_mid_stream_ends_with_an_error_event_then_done():
    closed = []

    async def chunks():
        try:
            yield Chunk("b", [2])
            raise EngineError("engine failed on replica r0")
        finally:
            closed.append(True)

    fmt = CompletionFormat("cmpl-1", "m")
    events = _events(asyncio.run(_drain(sse_events(chunks(), Chunk("a", [1]), fmt))))
    assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[2]["error"]["code"] == "engine_error" and "engine failed" in events[2]["error"]["message"]
    assert events[3] == "[DONE]" and closed == [True]


def test_collect_builds_one_response():
    chunks = _chunks(Chunk("The ", [1]), Chunk("end.", [2], "length", Usage(3, 2)))
    body = asyncio.run(collect(chunks, ChatFormat("chatcmpl-2", "m")))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "The end."}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 5
