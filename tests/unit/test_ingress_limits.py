"""What the HTTP ingress charges to API keys' and deployments' budgets, through the real ingress
app (tests/unit/ingress_app.py) over the real buckets."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from atomr_infer.errors import AdapterFailed, AdapterNotFound
from atomr_infer.serve import rate_limit
from atomr_infer.serve.rate_limit import Buckets, IngressLimits
from atomr_infer.wire import HttpHead, LastBytes
from tests.unit.ingress_app import USAGE, Limiter, ingress, post

ALICE = "sk-alice-0123456789"
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


def keys(**limits: int) -> str:
    extra = "".join(f", {k}: {v}" for k, v in limits.items())
    return f"keys: [{{name: alice, key: {ALICE}{extra}}}]"


def charged(limiter: Limiter, bucket: str) -> float:
    """Tokens charged to ``bucket`` after admission (take calls with a cost and no need)."""
    return sum(args[2] for name, args in limiter.calls if name == "take" and args[0] == bucket and args[3] == 0.0)


@pytest.mark.parametrize("stream", [1, "true", True])
def test_a_stream_vllm_reads_as_one_is_charged_its_tokens(stream) -> None:
    _ingress, limiter, app = ingress(keys(tokens_per_minute=1000))

    async def main():
        status, _headers, body = await post(app, "/v1/chat/completions", {**CHAT, "stream": stream}, ALICE)
        await asyncio.sleep(0)  # the charge is sent when the stream ends
        return status, body

    status, body = asyncio.run(main())
    assert status == 200 and b'"usage"' not in body  # asked of vLLM for the budget, hidden from the client
    assert charged(limiter, "key:alice:tokens") == USAGE["total_tokens"]


def test_a_background_response_is_refused_under_a_token_budget_and_served_without_one() -> None:
    body = {"model": "smollm2", "input": "hi", "background": True, "store": True}
    ingress_, _limiter, app = ingress(keys(tokens_per_minute=1000))
    status, _headers, answer = asyncio.run(post(app, "/v1/responses", body, ALICE))
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == "background" and "tokens_per_minute" in error["message"]
    assert ingress_._router.seen == []  # refused before any replica ran it
    ingress_, _limiter, app = ingress(keys())
    assert asyncio.run(post(app, "/v1/responses", body, ALICE))[0] == 200


def test_what_runs_no_engine_step_spends_no_request_budget() -> None:
    """/tokenize is open without a key: it spent the deployment's requests_per_minute, and every key got 429."""
    _ingress, _limiter, app = ingress(keys(), requests_per_minute=2)

    async def main():
        for _ in range(5):
            assert (await post(app, "/tokenize", {"model": "smollm2", "prompt": "hi"}))[0] == 200
        return [(await post(app, "/v1/chat/completions", CHAT, ALICE))[0] for _ in range(3)]

    assert asyncio.run(main()) == [200, 200, 429]


def test_only_a_caller_the_api_authenticated_may_start_a_replica() -> None:
    """/tokenize without a key was routed as demand: an anonymous caller woke a deployment scaled
    to zero (a GPU) as often as it liked (the router then refuses it at once: test_router_demand)."""
    ingress_, _limiter, app = ingress(keys())

    async def main():
        await post(app, "/tokenize", {"model": "smollm2", "prompt": "hi"})
        await post(app, "/tokenize", {"model": "smollm2", "prompt": "hi"}, ALICE)  # open, but a valid key
        await post(app, "/tokenize", {"model": "smollm2", "prompt": "hi"}, "sk-not-a-key-0123456789")
        await post(app, "/v1/chat/completions", CHAT, ALICE)

    asyncio.run(main())
    assert [facts.wakes for facts, _http in ingress_._router.seen] == [False, True, False, True]
    ingress_, _limiter, app = ingress()  # no keys: every caller may
    asyncio.run(post(app, "/tokenize", {"model": "smollm2", "prompt": "hi"}))
    assert [facts.wakes for facts, _http in ingress_._router.seen] == [True]


def test_a_request_the_deployment_refuses_does_not_spend_its_keys_budget() -> None:
    _ingress, limiter, app = ingress(keys(requests_per_minute=3), requests_per_minute=1)

    async def main():
        return [(await post(app, "/v1/chat/completions", CHAT, ALICE))[0] for _ in range(3)]

    assert asyncio.run(main()) == [200, 429, 429]
    key = limiter.buckets.take("key:alice:requests", 3, 0.0, 1.0)
    assert key.remaining == 2  # only the admitted request was taken from the key
    assert [name for name, _ in limiter.calls if name == "take_all"] == ["take_all"] * 3  # one call each


def test_take_all_takes_from_every_bucket_or_from_none() -> None:
    buckets = Buckets()
    asks = [("key", 5, 1.0, 1.0, "requests"), ("dep", 1, 1.0, 1.0, "requests")]
    assert all(v.allowed for v in buckets.take_all(asks))
    refused = buckets.take_all(asks)
    assert [v.allowed for v in refused] == [True, False]
    assert buckets.take("key", 5, 0.0, 1.0).remaining == 4  # the refused request took nothing


def test_a_lost_limiter_actor_is_looked_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead actor's handle failed every limited request (500) until the ingress restarted."""

    class Dead:
        class take_all:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote(_asks):
                raise RuntimeError("RayActorError: The actor died unexpectedly")

    fresh = Limiter()
    monkeypatch.setattr(rate_limit, "limiter_handle", lambda: fresh)
    limits = IngressLimits()
    limits._limiter = Dead()
    headers, token_budgets = asyncio.run(limits.admit("alice", (3, 100), None, (None, None)))
    assert headers["x-ratelimit-remaining-requests"] == "2" and [b.unit for b in token_budgets] == ["tokens"]
    assert limits._limiter is fresh


def test_an_unknown_name_lists_the_deployments_only_to_a_caller_with_a_key() -> None:
    """/tokenize is open without a key: its 404 listed every deployment, those no key may see too."""
    _ingress, _limiter, app = ingress(keys())

    async def main():
        anonymous = await post(app, "/tokenize", {"model": "nobody", "prompt": "hi"})
        keyed = await post(app, "/v1/chat/completions", {**CHAT, "model": "nobody"}, ALICE)
        return anonymous, keyed

    (status, _, body), (keyed_status, _, keyed_body) = asyncio.run(main())
    assert status == 404 and json.loads(body)["error"]["message"] == "no deployment named 'nobody'"
    assert keyed_status == 404 and "(deployments: smollm2)" in json.loads(keyed_body)["error"]["message"]


def answering(*chunks: bytes, content_type: str = "application/json") -> object:
    """A router's stream that answers ``chunks`` (the last one ends the answer)."""
    async def stream(facts, http):
        yield HttpHead(200, (("content-type", content_type),))
        for chunk in chunks[:-1]:
            yield chunk
        yield LastBytes(chunks[-1])
    return stream


COHERE_USAGE = {"billed_units": {"input_tokens": 900.0, "output_tokens": 4000.0},
                "tokens": {"input_tokens": 900.0, "output_tokens": 4000.0}}  # vLLM's CohereUsage


@pytest.mark.parametrize("stream", [False, True])
def test_a_cohere_chat_is_charged_its_usage_streamed_or_not(stream: bool) -> None:
    """/cohere/v2/chat reports usage.tokens (a stream: its message-end's delta.usage), as floats:
    it was charged nothing, and a key's tokens_per_minute never stopped it."""
    answer = {"id": "x", "finish_reason": "COMPLETE", "message": {"role": "assistant", "content": []},
              "usage": COHERE_USAGE}
    end = {"type": "message-end", "id": "x", "delta": {"finish_reason": "COMPLETE", "usage": COHERE_USAGE}}
    ingress_, limiter, app = ingress(keys(tokens_per_minute=1000))
    ingress_._router.stream = answering(b'data: {"type":"message-start","id":"x"}\n\n',
                                        b"data: " + json.dumps(end).encode() + b"\n\n",
                                        content_type="text/event-stream") if stream else answering(
                                            json.dumps(answer).encode())

    async def main():
        statuses = [(await post(app, "/cohere/v2/chat", {**CHAT, "stream": stream}, ALICE))[0] for _ in range(2)]
        await asyncio.sleep(0)
        return statuses

    assert asyncio.run(main()) == [200, 429]
    assert charged(limiter, "key:alice:tokens") == 4900


FORM = (b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nsmollm2\r\n--XyZ\r\n'
        b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
        + b"RIFF" * 4000 + b"\r\n--XyZ--\r\n")  # 16 kB of audio: not 4,000 tokens of prompt


async def transcribe(ingress_: object) -> int:
    scope = {"type": "http", "method": "POST", "path": "/v1/audio/transcriptions", "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=XyZ"),
                         (b"authorization", f"Bearer {ALICE}".encode())]}
    messages = [{"type": "http.request", "body": FORM, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    response = await ingress_.routed_by_form(Request(scope, receive))
    if isinstance(response, StreamingResponse):
        await response({"type": "http"}, receive, lambda message: asyncio.sleep(0))
    return response.status_code


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_reporting_no_token_usage_is_charged_an_estimate(stream: bool) -> None:
    """A transcription's usage is in seconds (a translation has none): audio was charged nothing.
    Now its answer's bytes / 4, or a stream's events (not its form's audio bytes)."""
    text = json.dumps({"text": "x" * 4000, "usage": {"type": "duration", "seconds": 600}}).encode()
    event = b'data: {"object":"transcription.chunk","choices":[{"delta":{"content":"hi"}}]}\n\n'
    ingress_, limiter, _app = ingress(keys(tokens_per_minute=1000))
    ingress_._router.stream = answering(*[event] * 3, b"data: [DONE]\n\n", content_type="text/event-stream") \
        if stream else answering(text)

    async def main():
        return [await transcribe(ingress_) for _ in range(2)]

    statuses = asyncio.run(main())
    assert charged(limiter, "key:alice:tokens") == (2 * 4 if stream else len(text) // 4)  # 4: [DONE] is one
    assert statuses == ([200, 200] if stream else [200, 429])


@pytest.mark.parametrize("error", [
    AdapterNotFound("smollm2", "x", ["pirate", "robot"]),
    AdapterFailed("smollm2", "x", "failed: adapter 'smollm2:x' from /srv/adapters/x: no adapter_config.json"),
])
def test_an_unknown_or_failed_adapter_lists_nothing_and_names_no_path_to_a_caller_without_a_key(error) -> None:
    """The check matched DeploymentNotFound alone, not its adapter subclasses: /tokenize without a
    key answered a deployment's adapters, and why one failed, with the server's paths."""
    ingress_, _limiter, app = ingress(keys())

    async def refusing(facts, http):
        raise error
        yield  # an async generator, as the router's stream is

    ingress_._router.stream = refusing

    async def main():
        return [await post(app, path, {"model": "smollm2:x", "prompt": "hi"}, key)
                for path, key in (("/tokenize", None), ("/v1/completions", ALICE))]

    (status, _, body), (keyed_status, _, keyed_body) = asyncio.run(main())
    anonymous, keyed = json.loads(body)["error"]["message"], json.loads(keyed_body)["error"]["message"]
    assert status == keyed_status == 404 and anonymous.startswith("deployment 'smollm2' has no adapter 'x'"
                                                                  if type(error) is AdapterNotFound else
                                                                  "adapter 'x' of deployment 'smollm2' failed to load")
    assert "pirate" not in anonymous and "/srv" not in anonymous
    assert ("pirate" in keyed) if type(error) is AdapterNotFound else ("/srv/adapters/x" in keyed)
    assert str(type(error)(*error.args)) == str(error)  # crosses Ray
