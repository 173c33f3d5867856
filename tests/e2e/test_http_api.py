"""The OpenAI-compatible HTTP API driven as a user drives it: the ``openai`` client (and raw
``httpx`` where a client must hang up early) against a local ``atomr serve``."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import smollm2_spec
from tests.e2e.conftest import REPLICA_WAIT_S
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = 1900  # tokens: far more than a test waits for, within max_model_len=2048


@pytest.fixture(scope="module")
def client(openai_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def second(manager, ray_cluster, openai_server):
    """A second deployment ``smollm2-two`` (its own replica), removed at the end."""
    name = "smollm2-two"
    ray_cluster.get(manager.apply.remote(smollm2_spec(name=name)))
    # While its engine starts, /health names it as not ready.
    health = httpx.get(f"{openai_server.url}/health", timeout=30)
    status = ray_cluster.get(manager.wait_ready.remote(name, 600))
    assert status is not None and status.replicas_ready == 1, status
    actor_name = status.replicas[0].actor_name
    replica = ray_cluster.get_actor(actor_name, namespace="atomr")
    yield {"name": name, "replica": replica, "health_while_starting": health}
    ray_cluster.get(manager.remove.remote(name))


def error_of(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


# -- answers ---------------------------------------------------------------------------------


def test_chat_answers_the_question(client, smollm2):
    resp = client.chat.completions.create(model=smollm2, messages=CHAT, temperature=0, max_tokens=32)
    assert resp.object == "chat.completion" and resp.model == smollm2
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion(client, smollm2):
    resp = client.completions.create(model=smollm2, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text.strip()
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert 0 < resp.usage.completion_tokens <= 8


def test_streaming_chat_with_usage_matches_the_whole_answer(client, smollm2):
    args = dict(model=smollm2, messages=CHAT, temperature=0, max_completion_tokens=24)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in content)
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_streaming_completion(client, smollm2):
    args = dict(model=smollm2, prompt="Paris is the capital of", max_tokens=12, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_models_list_and_retrieve(client, smollm2):
    ids = [m.id for m in client.models.list()]
    assert smollm2 in ids
    model = client.models.retrieve(smollm2)
    assert model.id == smollm2 and model.owned_by == "atomr"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_is_ok_when_every_deployment_is_ready(openai_server, smollm2):
    resp = httpx.get(f"{openai_server.url}/health", timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "ok" and body["manager"] == "ready"
    assert body["deployments"][smollm2]["replicas_ready"] == 1


# -- errors ----------------------------------------------------------------------------------


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    err = error_of(info.value)
    assert info.value.status_code == 404
    assert "no-such-model" in err["message"] and err["code"] == "model_not_found" and err["param"] == "model"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_over_the_context_is_400_naming_the_limit(client, smollm2, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=smollm2, messages=CHAT, **{field: 4000})
    err = error_of(info.value)  # vLLM's own error, as `vllm serve` answers it
    assert err["param"] == field and "2048" in err["message"] and "4000" in err["message"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens")],
)
def test_bad_values_are_400_naming_the_param(client, smollm2, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=smollm2, messages=CHAT, **kwargs)
    err = error_of(info.value)
    assert err["param"] == param and param in err["message"]


def test_fields_vllm_serve_accepts_are_served(client, smollm2):
    # Each of these was a 400 from our own request layer before vLLM's served in the replica.
    resp = client.chat.completions.create(
        model=smollm2, messages=CHAT, max_tokens=8, n=2, seed=3, logprobs=True, top_logprobs=2,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"42": -100},
        response_format={"type": "json_object"}, extra_body={"min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert len(resp.choices) == 2 and resp.choices[0].logprobs.content
    echo = client.completions.create(model=smollm2, prompt="Paris is", max_tokens=4, echo=True)
    assert echo.choices[0].text.startswith("Paris is")


HOSTILE = [
    (b"[" * 100_000, "nests deeper"),
    (b'{"model": "smollm2", "messages": ' + b"[" * 500 + b"]" * 500 + b"}", "nests deeper"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (b'{"model": "smollm2", "messages": [], "max_tokens": Infinity}', "Infinity"),
    (b'{"model": 5, "messages": "hi"}', "model"),
    (b'["not", "an", "object"]', ""),
    (b"null", ""),
]


def test_hostile_bodies_are_4xx_with_an_openai_error_and_the_ingress_keeps_serving(openai_server, client, smollm2):
    url = f"{openai_server.base_url}/chat/completions"
    headers = {"Content-Type": "application/json"}
    for body, words in HOSTILE:
        resp = httpx.post(url, content=body, headers=headers, timeout=30)
        assert resp.status_code == 400, (body[:80], resp.status_code, resp.text[:300])
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and words in err["message"], (body[:80], err)
    # Over the size limit: 413 naming it, refused from the declared length and from a chunked upload.
    from atomr_infer.serve.body import MAX_BODY_BYTES

    big = b'{"model": "smollm2", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    resp = httpx.post(f"{openai_server.base_url}/completions", content=big, headers=headers, timeout=60)
    assert resp.status_code == 413 and str(MAX_BODY_BYTES) in resp.json()["error"]["message"]
    chunked = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))  # no Content-Length
    resp = httpx.post(f"{openai_server.base_url}/completions", content=chunked, headers=headers, timeout=60)
    assert resp.status_code == 413
    # A well-formed body with a wrong type inside is vLLM's to refuse, as `vllm serve` does.
    wrong = b'{"model": "smollm2", "messages": [{"role": "user", "content": {"a": 1}}]}'
    assert httpx.post(url, content=wrong, headers=headers, timeout=30).status_code == 400
    answer = client.chat.completions.create(model=smollm2, messages=CHAT, max_tokens=8)
    assert answer.choices[0].message.content


def test_no_ready_replica_is_503(client, manager, ray_cluster):
    name = "smollm2-zero"
    ray_cluster.get(manager.apply.remote(smollm2_spec(name=name, replicas=0)))
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=name, messages=CHAT, max_tokens=4)
        assert info.value.status_code == 503
        assert info.value.response.headers.get("retry-after")
        assert "no ready replica" in error_of(info.value)["message"]
    finally:
        ray_cluster.get(manager.remove.remote(name))


def test_a_deployment_scaled_to_zero_starts_on_its_first_request_and_serves_it(client, manager, ray_cluster):
    """Scale from zero with the real engine: the request waits (longer than the ingress's usual
    wait for a replica) while the manager starts one, then gets its answer."""
    name = "smollm2-cold"
    scaling = {"min_replicas": 0, "max_replicas": 1, "downscale_delay_s": 600, "cold_start_timeout_s": 300}
    ray_cluster.get(manager.apply.remote(smollm2_spec(name=name, replicas=0, autoscaling=scaling)))
    try:
        idle = ray_cluster.get(manager.status.remote(name))
        assert (idle.state, idle.replicas_desired) == ("idle", 0)
        started = time.monotonic()
        answer = client.with_options(timeout=300).chat.completions.create(model=name, messages=CHAT, max_tokens=8)
        assert answer.choices[0].message.content
        waited = time.monotonic() - started
        assert waited > REPLICA_WAIT_S  # it did wait for an engine to start
        print(f"\nscale from zero over HTTP: the first request answered in {waited:.1f} s")
        status = ray_cluster.get(manager.status.remote(name))
        assert status.replicas_ready == 1 and status.autoscaling["last_decision"]["reason"].startswith("cold start")
    finally:
        ray_cluster.get(manager.remove.remote(name))


# -- disconnect ------------------------------------------------------------------------------


def _chat_body(model: str, stream: bool) -> dict:
    return {"model": model, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True, "stream": stream}


def test_closing_a_stream_aborts_the_request(openai_server, smollm2, smollm2_replica, ray_cluster):
    aborted_before = ray_cluster.get(smollm2_replica.stats.remote()).requests_aborted
    url = f"{openai_server.base_url}/chat/completions"
    with httpx.stream("POST", url, json=_chat_body(smollm2, stream=True), timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # keep it: closing this iterator would hang up
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] is not None
        assert ray_cluster.get(smollm2_replica.in_flight.remote()) == 1
    # The client hung up long before 1900 tokens: the engine request must be gone (a liveness
    # bound; the count of aborts below tells an abort from an answer that ran to its end).
    assert wait_until(lambda: ray_cluster.get(smollm2_replica.in_flight.remote()) == 0, 30.0)
    assert ray_cluster.get(smollm2_replica.stats.remote()).requests_aborted == aborted_before + 1


def test_hanging_up_a_non_streaming_request_aborts_it(openai_server, smollm2, smollm2_replica, ray_cluster):
    aborted_before = ray_cluster.get(smollm2_replica.stats.remote()).requests_aborted
    url = f"{openai_server.base_url}/chat/completions"
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            httpx.post(url, json=_chat_body(smollm2, stream=False), timeout=httpx.Timeout(60, read=3.0))
        except httpx.ReadTimeout as exc:  # the client gives up and closes the connection
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert wait_until(lambda: ray_cluster.get(smollm2_replica.in_flight.remote()) == 1, 3.0)
    caller.join(30)
    assert outcome, "the request was expected to time out on the client"
    assert wait_until(lambda: ray_cluster.get(smollm2_replica.in_flight.remote()) == 0, 30.0)
    assert ray_cluster.get(smollm2_replica.stats.remote()).requests_aborted == aborted_before + 1


# -- two deployments -------------------------------------------------------------------------


def test_health_names_a_deployment_that_is_not_ready(second):
    health = second["health_while_starting"]
    assert health.status_code == 503, health.text
    assert second["name"] in health.json()["not_ready"]


def test_two_deployments_are_routed_by_name(client, smollm2, smollm2_replica, second, ray_cluster):
    def started(replica) -> int:
        return ray_cluster.get(replica.stats.remote()).requests_started

    before = (started(smollm2_replica), started(second["replica"]))
    for _ in range(2):
        resp = client.chat.completions.create(model=second["name"], messages=CHAT, max_tokens=4)
        assert resp.model == second["name"]
    resp = client.chat.completions.create(model=smollm2, messages=CHAT, max_tokens=4)
    assert resp.model == smollm2
    assert (started(smollm2_replica), started(second["replica"])) == (before[0] + 1, before[1] + 2)
    assert {smollm2, second["name"]} <= {m.id for m in client.models.list()}


def test_capacity_exhausted_with_reject_is_429(client, openai_server, manager, ray_cluster, second):
    name = second["name"]
    spec = smollm2_spec(name=name, serving={"max_concurrent": 1, "on_capacity_exhausted": "reject"})
    result = ray_cluster.get(manager.apply.remote(spec))
    assert result.changed
    url = f"{openai_server.base_url}/chat/completions"
    with httpx.stream("POST", url, json=_chat_body(name, stream=True), timeout=60) as long_running:
        assert long_running.status_code == 200
        lines = long_running.iter_lines()  # keep it: closing this iterator would hang up
        next(line for line in lines if line.startswith("data: "))

        def rejected() -> bool:  # the ingress sees the new limit as soon as its table is pushed
            try:
                client.chat.completions.create(model=name, messages=CHAT, max_tokens=1)
            except openai.RateLimitError:
                return True
            return False

        assert wait_until(rejected, 10.0, interval_s=0.2)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=name, messages=CHAT, max_tokens=1)
    assert info.value.status_code == 429
    assert int(info.value.response.headers["retry-after"]) >= 1
    err = error_of(info.value)
    assert err["type"] == "rate_limit_error" and "max_concurrent=1" in err["message"]
