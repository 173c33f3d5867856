"""What the HTTP ingress charges to API keys' and deployments' budgets, through the real ingress
app (tests/unit/ingress_app.py) over the real buckets."""

from __future__ import annotations

import asyncio
import json

import pytest

from atomr_infer.serve import rate_limit
from atomr_infer.serve.rate_limit import Buckets, IngressLimits
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
