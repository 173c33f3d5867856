"""vLLM's own OpenAI server in the replica: requests sent to ``VllmReplica.http`` as the ingress
sends them, answered by vLLM's app over the replica's step loop (real Ray, real vLLM on CPU)."""

from __future__ import annotations

import json

import pytest
import ray

from atomr_infer.wire import HttpHead, HttpRequest

pytestmark = pytest.mark.integration
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
JSON = (("content-type", "application/json"),)


def call(replica, path: str, body: dict) -> tuple[HttpHead, bytes]:
    return call_request(replica, HttpRequest("POST", path, JSON, json.dumps(body).encode()))


def call_request(replica, request: HttpRequest) -> tuple[HttpHead, bytes]:
    head, *chunks = [ray.get(ref) for ref in replica.http.remote(request)]
    assert isinstance(head, HttpHead)
    return head, b"".join(chunks)


def test_chat_answers_with_vllms_response(smollm2_replica):
    head, body = call(smollm2_replica, "/v1/chat/completions",
                      {"model": "smollm2", "messages": CHAT, "temperature": 0, "max_tokens": 16})
    assert head.status == 200, body
    data = json.loads(body)
    assert data["object"] == "chat.completion" and "Paris" in data["choices"][0]["message"]["content"]


def test_streaming_chat_is_sse_from_vllm(smollm2_replica):
    head, body = call(smollm2_replica, "/v1/chat/completions", {
        "model": "smollm2", "messages": CHAT, "temperature": 0, "max_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True},
    })
    assert head.status == 200 and ("content-type", "text/event-stream; charset=utf-8") in head.headers
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] > 0
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert "Paris" in text


@pytest.mark.parametrize(
    "extra",
    [
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"42": -100}},
        {"logprobs": True, "top_logprobs": 2},
        {"n": 2, "seed": 7, "temperature": 1.0},
        {"response_format": {"type": "json_object"}},
        {"min_p": 0.1, "repetition_penalty": 1.1},
    ],
)
def test_fields_our_old_layer_refused_are_served(smollm2_replica, extra):
    head, body = call(smollm2_replica, "/v1/chat/completions",
                      {"model": "smollm2", "messages": CHAT, "max_tokens": 8, **extra})
    assert head.status == 200, body
    data = json.loads(body)
    assert len(data["choices"]) == extra.get("n", 1)


def test_vllms_errors_come_back_unchanged(smollm2_replica):
    head, body = call(smollm2_replica, "/v1/chat/completions",
                      {"model": "smollm2", "messages": CHAT, "temperature": -1})
    assert head.status == 400
    assert json.loads(body)["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("stream", [False, True])
def test_cancelling_the_call_aborts_the_request_in_the_engine(smollm2_replica, stream):
    import time

    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 1800, "ignore_eos": True, "stream": stream}
    before = ray.get(smollm2_replica.stats.remote()).requests_aborted
    gen = smollm2_replica.http.remote(HttpRequest("POST", "/v1/chat/completions", JSON, json.dumps(body).encode()))
    deadline = time.monotonic() + 10
    while ray.get(smollm2_replica.in_flight.remote()) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray.cancel(gen)
    deadline = time.monotonic() + 5
    while ray.get(smollm2_replica.in_flight.remote()) != 0:
        assert time.monotonic() < deadline, "not aborted"
        time.sleep(0.05)
    assert ray.get(smollm2_replica.stats.remote()).requests_aborted == before + 1


def test_a_stored_response_is_kept_under_the_id_the_router_set(smollm2_replica):
    from atomr_infer.routing import response_ids

    minted = response_ids.mint("smollm2", "r0")
    sent = HttpRequest("POST", "/v1/responses", JSON, json.dumps(
        {"model": "smollm2", "input": "Say hi.", "max_output_tokens": 8, "store": True}).encode())
    head, body = call_request(smollm2_replica, response_ids.with_request_id(sent, minted))
    assert head.status == 200 and json.loads(body)["id"] == minted, body
    head, body = call_request(smollm2_replica, HttpRequest("GET", f"/v1/responses/{minted}", (), b""))
    assert head.status == 200 and json.loads(body)["id"] == minted, body


def test_the_control_plane_resets_every_replicas_prefix_cache(manager, smollm2, smollm2_replica):
    from atomr_infer.control.client import ControlPlane

    call(smollm2_replica, "/v1/completions", {"model": "smollm2", "prompt": "The capital of France", "max_tokens": 2})
    assert ControlPlane(manager).reset_prefix_cache(smollm2) == {"r0": "reset"}


def test_a_replica_reports_the_routes_its_model_serves(manager, smollm2, ray_cluster):
    status = ray_cluster.get(manager.status.remote(smollm2))
    routes = status.replicas[0].routes
    assert "POST /v1/chat/completions" in routes and "POST /v1/responses" in routes
    assert "POST /v1/embeddings" not in routes  # a generating model: no pooling routes


def test_the_replica_tokenizes_short_text_prompts_on_its_event_loop(smollm2_replica):
    """The bundled model's renderer holds vLLM's thread-safe tokenizer pool, so the replica's
    engine client tokenizes short text prompts inline (engine/vllm/inline_tokenize.py), and a
    completion still answers."""
    inline = ray.get(smollm2_replica.__ray_call__.remote(
        lambda replica: getattr(replica._backend._client.renderer._tokenize_prompt_async, "atomr_inline", False)
    ))
    assert inline is True
    head, raw = call(smollm2_replica, "/v1/completions", {"model": "smollm2", "prompt": "Paris is", "max_tokens": 4})
    assert head.status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def test_two_requests_with_one_id_run_at_once_on_one_replica(smollm2_replica):
    """A client's retry while its first attempt still runs (the same request_id, or X-Request-Id):
    both are served, as by vllm serve, whose engine makes ids unique; the chunks keep the id."""
    from tests.replica_http import http_request, read

    body = {"model": "smollm2", "prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "request_id": "twice"}  # ignore_eos: both run their 24 tokens, whatever the sampling
    calls = [smollm2_replica.http.remote(http_request("/v1/completions", dict(body))) for _ in range(2)]
    answers = [read([ray.get(ref) for ref in call]) for call in calls]
    for answer in answers:
        assert answer.status == 200 and answer.finish_reason == "length", answer.body[-400:]
        assert {e["id"] for e in answer.events} == {"cmpl-twice"}, answer.events[:2]
