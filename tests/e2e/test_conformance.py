"""Conformance with ``vllm serve``: the same requests to it and to ``atomr serve`` (the same
model, engine arguments and server options) get the same responses, apart from ids and
timestamps. Both run vLLM's OpenAI serving code; this checks that atomr's routing, its engine
client over the step loop and its transport change nothing a client can see.

Prefix caching is off on both sides: a cache hit changes the prefill's kernels, and with
native bf16 that can change a greedy token. Requests go one at a time, so batches are alike.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import smollm2_spec
from tests.vllm_serve import vllm_server

pytestmark = pytest.mark.e2e
NAME = "conform"
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
    openai = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
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


_VOLATILE = {"id", "created", "system_fingerprint"}


def _stable(value: Any) -> Any:
    """The response without what differs on every call: ids and timestamps."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _answer(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    resp = httpx.post(base + path, json=body, timeout=120)
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
    "completion_echo": completion(echo=True),
    "completion_prompts": completion(prompt=["The capital of France is", "Two plus two is"]),
    "completion_logprobs": completion(logprobs=2),
    "completion_stream": completion(stream=True, stream_options={"include_usage": True}),
    "bad_temperature": chat(temperature=-1),
    "over_context": chat(max_tokens=5000),
    "bad_tool_choice": chat(tool_choice={"type": "function", "function": {"name": "nope"}}),
}


ERRORS = {"bad_temperature", "over_context", "bad_tool_choice"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_response_as_vllm_serve(vllm_serve, atomr, case):
    path, body = CASES[case]
    ours, theirs = _answer(atomr, path, body), _answer(vllm_serve, path, body)
    assert ours[0] == (400 if case in ERRORS else 200), ours
    if body.get("stream"):  # read whole: something was generated, and the stream ended
        assert ours[1]["done"] and any(c["text"] or c["tool_calls"] for c in ours[1]["choices"].values()), ours
    assert ours == theirs


def test_tokenize_and_detokenize_match(vllm_serve, atomr):
    for path, body in (("/tokenize", {"model": NAME, "prompt": "Hello Paris"}),
                       ("/tokenize", {"model": NAME, "messages": CHAT}),
                       ("/detokenize", {"model": NAME, "tokens": [19556, 7042]})):
        ours = _answer(atomr, path, body)
        assert ours[0] == 200 and ours == _answer(vllm_serve, path, body)


def embed_spec():
    from atomr_infer.spec import load_deployments
    from tests.conftest import REPO

    return load_deployments(os.path.join(REPO, "deployments", "smollm2-embed.yaml"))[0]


@pytest.fixture(scope="module")
def embed_servers(bundled_model_dir, manager, ray_cluster, openai_server) -> Iterator[tuple[str, str]]:
    """deployments/smollm2-embed.yaml on atomr, and `vllm serve` with the same flags."""
    spec = embed_spec()
    ray_cluster.get(manager.apply.remote(spec))
    try:
        status = ray_cluster.get(manager.wait_ready.remote(spec.name, 600))
        assert status is not None and status.replicas_ready == 1, status
        with vllm_server(spec, bundled_model_dir) as theirs:
            yield openai_server.url, theirs
    finally:
        ray_cluster.get(manager.remove.remote(spec.name))


def test_embeddings_are_the_same_vectors(embed_servers):
    ours_url, theirs_url = embed_servers
    for body in ({"model": "smollm2-embed", "input": "Paris is the capital of France."},
                 {"model": "smollm2-embed", "input": ["one", "two words", "three more words"]}):
        ours, theirs = _answer(ours_url, "/v1/embeddings", body), _answer(theirs_url, "/v1/embeddings", body)
        assert ours[0] == 200 and len(ours[1]["data"][0]["embedding"]) > 100, ours
        assert ours == theirs
