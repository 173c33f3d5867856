"""Conformance with ``vllm serve``: the same requests to it and to ``atomr serve`` (the same
model, engine arguments and server options) get the same responses, apart from ids and
timestamps. Both run vLLM's OpenAI serving code; this checks that atomr's routing, its engine
client over the step loop and its transport change nothing a client can see.

Prefix caching is off on both sides: a cache hit changes the prefill's kernels, and with
native bf16 that can change a greedy token. Requests go one at a time, so batches are alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from unittest.mock import ANY

import httpx
import pytest

from tests.conftest import smollm2_spec
from tests.vllm_serve import vllm_server

pytestmark = pytest.mark.e2e
NAME = "conform"
# serving.openai.served_model_name, Hub-style: vllm serve --served-model-name conform conform/alias
ALIAS = "conform/alias"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITY_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def conform_spec():
    rc = {**smollm2_spec().runtime_config.model_dump(), "enable_prefix_caching": False, "max_num_seqs": 16}
    openai = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "response_store": {"enabled": True},
              "served_model_name": [ALIAS]}
    return smollm2_spec(name=NAME, runtime_config=rc, serving={"max_concurrent": 16, "openai": openai})


@pytest.fixture(scope="module")
def vllm_serve(bundled_model_dir) -> Iterator[str]:
    with vllm_server(conform_spec(), bundled_model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def atomr(manager, ray_cluster, openai_server) -> Iterator[str]:
    ray_cluster.get(manager.apply.remote(conform_spec()))
    status = ray_cluster.get(manager.wait_ready.remote(NAME, 600))
    assert status is not None and status.replicas_ready == 1, status
    yield openai_server.url
    ray_cluster.get(manager.remove.remote(NAME))


_VOLATILE = {"id", "created", "created_at", "system_fingerprint", "previous_response_id"}


def _stable(value: Any) -> Any:
    """The response without what differs on every call: ids and timestamps."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _answer(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    resp = httpx.post(base + path, json=body, timeout=120)
    if body.get("stream") and resp.text.startswith("event: "):  # Responses and Messages: typed events
        return resp.status_code, _read_typed(resp.text)
    if body.get("stream"):
        events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e.strip()]
        return resp.status_code, _read_whole([e if e == "[DONE]" else _stable(json.loads(e)) for e in events])
    return resp.status_code, _stable(resp.json())


def _read_whole(events: list[Any]) -> dict[str, Any]:
    """A stream as a client reads it to the end: per choice the text, tool calls and logprobs
    joined, and the finish reason; the usage; the fields the events carry; the [DONE] at the
    end. Not where the deltas are cut into events: vLLM merges the deltas a reader has not
    taken yet into one (its output collector), so the cuts depend on timing on both sides."""
    choices: dict[int, dict[str, Any]] = {}
    usage, fields = None, set()
    for event in events[:-1] if events and events[-1] == "[DONE]" else events:
        fields |= {f"{k}" for k in event} | {f"choices.{k}" for c in event.get("choices", []) for k in c}
        usage = event.get("usage") or usage
        for c in event.get("choices", []):
            whole = choices.setdefault(c["index"], {"text": "", "tool_calls": {}, "logprobs": {}, "finish": None})
            delta = c.get("delta") or {}
            whole["text"] += c.get("text") or delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                joined = whole["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                for key in ("name", "arguments"):
                    joined[key] += (call.get("function") or {}).get(key) or ""
            for key, value in (c.get("logprobs") or {}).items():  # chat: content; completions: lists
                if isinstance(value, list):
                    whole["logprobs"][key] = whole["logprobs"].get(key, []) + value
            whole["finish"] = c.get("finish_reason") or whole["finish"]
    return {"choices": choices, "usage": usage, "fields": sorted(fields), "done": events[-1:] == ["[DONE]"]}


def _read_typed(text: str) -> dict[str, Any]:
    """A stream of typed events (``event:`` then ``data:``: Responses, Messages) as a client
    reads it whole: the text of its deltas joined, which event types came, and its last event
    (the finished response or message) without ids, timestamps and sequence numbers."""
    events = []
    for block in text.split("\n\n"):
        data = next((line[len("data: "):] for line in block.splitlines() if line.startswith("data: ")), None)
        if data is not None:
            events.append(json.loads(data))
    joined = ""
    for event in events:
        delta = event.get("delta")
        joined += delta if isinstance(delta, str) else (delta or {}).get("text", "") if isinstance(delta, dict) else ""
    last = {k: v for k, v in events[-1].items() if k != "sequence_number"} if events else None
    return {"text": joined, "types": sorted({e.get("type") for e in events}), "last": _stable(last)}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 24, "temperature": 0, **fields}


def completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": NAME, "prompt": "The capital of France is", "max_tokens": 12,
                               "temperature": 0, **fields}


CASES = {
    "plain": chat(),
    "penalties": chat(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.2),
    "logit_bias": chat(logit_bias={"9576": -100, "330": 5}),
    "logprobs": chat(logprobs=True, top_logprobs=3),
    "n_and_seed": chat(n=2, seed=1234, temperature=0.9),
    "json_object": chat(response_format={"type": "json_object"}, max_tokens=32),
    "json_schema": chat(response_format=CITY_SCHEMA, max_tokens=32),
    "named_tool": chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "required_tool": chat(tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48),
    "auto_tool": chat(tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=48),
    "stop": chat(stop=["Paris"], stop_token_ids=[30]),
    "min_tokens": chat(min_tokens=20, max_tokens=24),
    "stream_usage_logprobs": chat(stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=1),
    "stream_tool": chat(stream=True, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48),
    "alias": chat(model=ALIAS),
    "alias_stream": chat(model=ALIAS, stream=True),
    "completion_echo": completion(echo=True),
    "completion_prompts": completion(prompt=["The capital of France is", "Two plus two is"]),
    "completion_logprobs": completion(logprobs=2),
    "completion_stream": completion(stream=True, stream_options={"include_usage": True}),
    "bad_temperature": chat(temperature=-1),
    "over_context": chat(max_tokens=5000),
    "bad_tool_choice": chat(tool_choice={"type": "function", "function": {"name": "nope"}}),
}


def responses(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"model": NAME, "input": CHAT[0]["content"], "max_output_tokens": 24, "temperature": 0,
                             **fields}


def messages(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {"model": NAME, "messages": CHAT, "max_tokens": 24, "temperature": 0, **fields}


WEATHER_TOOL_ANTHROPIC = {"name": "get_weather", "description": "The weather in a city.",
                          "input_schema": WEATHER_TOOL["function"]["parameters"]}
CASES |= {
    "responses": responses(),
    "responses_instructions": responses(instructions="Answer in French."),
    "responses_stream": responses(stream=True),
    "responses_bad_temperature": responses(temperature=-1),
    "messages": messages(),
    "messages_system": messages(system="You are terse."),
    "messages_stream": messages(stream=True),
    "messages_tool": messages(tools=[WEATHER_TOOL_ANTHROPIC], tool_choice={"type": "tool", "name": "get_weather"},
                              max_tokens=48),
    "messages_bad_max_tokens": messages(max_tokens=-1),
    "count_tokens": ("/v1/messages/count_tokens", {"model": NAME, "messages": CHAT}),
    # vLLM serves these only with --enable-scale-out (a server flag atomr does not set): its 403.
    "chat_render": ("/v1/chat/completions/render", chat()[1]),
    "completion_render": ("/v1/completions/render", completion()[1]),
}
STATUS = {"chat_render": 403, "completion_render": 403}
ERRORS = {"bad_temperature", "over_context", "bad_tool_choice", "responses_bad_temperature", "messages_bad_max_tokens"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_response_as_vllm_serve(vllm_serve, atomr, case):
    path, body = CASES[case]
    ours, theirs = _answer(atomr, path, body), _answer(vllm_serve, path, body)
    assert ours[0] == STATUS.get(case, 400 if case in ERRORS else 200), ours
    if body.get("stream") and "choices" in ours[1]:  # read whole: something was generated, and the stream ended
        assert ours[1]["done"] and any(c["text"] or c["tool_calls"] for c in ours[1]["choices"].values()), ours
    elif body.get("stream"):
        assert ours[1]["text"], ours
    assert ours == theirs


def test_model_cards_list_every_served_name_with_vllms_fields(vllm_serve, atomr):
    cards = {}
    for base in (atomr, vllm_serve):
        listed = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
        cards[base] = {c["id"]: c for c in listed if c["id"] in (NAME, ALIAS)}
    alias = httpx.get(f"{atomr}/v1/models/{ALIAS}", timeout=60)  # (vllm serve has no such route)
    assert alias.status_code == 200 and alias.json() == {**cards[atomr][ALIAS], "permission": ANY}, alias.text
    ours, theirs = cards[atomr], cards[vllm_serve]
    assert set(ours) == set(theirs) == {NAME, ALIAS}
    for name, card in theirs.items():
        assert set(card) <= set(ours[name]), (card, ours[name])  # and `endpoints`, atomr's own
        assert ours[name]["max_model_len"] == card["max_model_len"] == 2048
        assert (ours[name]["object"], ours[name]["parent"]) == (card["object"], card["parent"])
        assert set(ours[name]["permission"][0]) == set(card["permission"][0])


def test_a_streams_request_id_names_its_chunks_as_on_vllm_serve(vllm_serve, atomr):
    """A stream that may move to another replica is named by the router, unless the body names it."""
    for base in (atomr, vllm_serve):
        path, body = chat(stream=True, request_id="conform-req-1", max_tokens=4)
        events = [e.removeprefix("data: ") for e in httpx.post(base + path, json=body, timeout=120).text.split("\n\n")]
        ids = {json.loads(e)["id"] for e in events if e.strip() and e != "[DONE]"}
        assert ids == {"chatcmpl-conform-req-1"}, (base, ids)


def test_a_web_page_on_another_origin_gets_the_same_cors_answers(vllm_serve, atomr):
    """Both with their defaults (no origin allowed, any method and header; no credentials): a
    browser's preflight of a chat request (refused), then the request itself and a model listing
    from that origin (answered, with nothing that lets a browser hand them to the page)."""
    page = {"origin": "https://app.example"}
    preflight = {**page, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    path, body = chat(max_tokens=4)

    def cors(reply: httpx.Response) -> tuple[int, dict[str, str]]:
        return reply.status_code, {k: v for k, v in reply.headers.items() if k.startswith("access-control-")}

    seen = {}
    for base in (atomr, vllm_serve):
        seen[base] = [cors(httpx.options(base + path, headers=preflight, timeout=60)),
                      cors(httpx.post(base + path, json=body, headers=page, timeout=120)),
                      cors(httpx.get(f"{base}/v1/models", headers=page, timeout=60))]
    assert seen[atomr][0][0] == 400 and not any("allow-origin" in h for _, got in seen[atomr] for h in got), seen
    assert seen[atomr] == seen[vllm_serve]


def test_tokenize_and_detokenize_match(vllm_serve, atomr):
    for path, body in (("/tokenize", {"model": NAME, "prompt": "Hello Paris"}),
                       ("/tokenize", {"model": NAME, "messages": CHAT}),
                       ("/detokenize", {"model": NAME, "tokens": [19556, 7042]})):
        ours = _answer(atomr, path, body)
        assert ours[0] == 200 and ours == _answer(vllm_serve, path, body)


def test_stored_responses_and_their_errors_match(vllm_serve, atomr):
    """A chain through previous_response_id, a retrieve, a cancel of a finished response, and ids
    neither server holds (one of atomr's form, one not): the same statuses and bodies."""
    answers = []
    for base in (atomr, vllm_serve):
        first = httpx.post(base + "/v1/responses", json=responses(store=True)[1], timeout=120).json()
        second = responses(store=True, previous_response_id=first["id"], input="And of Italy?")[1]
        got = [httpx.post(base + "/v1/responses", json=second, timeout=120)]
        got.append(httpx.get(f"{base}/v1/responses/{first['id']}", timeout=60))
        got.append(httpx.post(f"{base}/v1/responses/{first['id']}/cancel", timeout=60))
        for unknown in ("resp_0123456789abcdef", f"resp_{NAME}.r0.0123456789abcdef"):
            got.append(httpx.get(f"{base}/v1/responses/{unknown}", timeout=60))
            got.append(httpx.post(f"{base}/v1/responses/{unknown}/cancel", timeout=60))
        got.append(httpx.post(base + "/v1/responses", json=responses(previous_response_id="resp_x.r9.00")[1],
                              timeout=60))
        assert got[1].json()["id"] == first["id"], got[1].text  # the stored response itself
        answers.append([(r.status_code, _stable(r.json())) for r in got])
    ours, theirs = answers
    assert [status for status, _ in ours] == [200, 200, 400, 404, 404, 404, 404, 404], ours
    assert ours == theirs


def test_audio_routes_answer_as_vllm_serve_does_for_a_model_without_speech(vllm_serve, atomr):
    """No speech model can be had here: the form is routed by its `model` to the bundled model,
    whose server has no transcription route, and answers as `vllm serve` with it does."""
    files = {"file": ("a.wav", b"RIFF0000WAVEfmt ", "audio/wav")}
    answers = [
        [(r.status_code, r.json()) for r in (
            httpx.post(f"{base}/v1/audio/transcriptions", data={"model": NAME}, files=files, timeout=60),
            httpx.post(f"{base}/v1/audio/translations", data={"model": NAME}, files=files, timeout=60),
        )]
        for base in (atomr, vllm_serve)
    ]
    assert answers[0] == answers[1] == [(404, {"detail": "Not Found"})] * 2
