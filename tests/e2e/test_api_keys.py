"""API keys and request limits over real HTTP, with the openai client and httpx: 401 without a
valid key, 403 for a deployment the key may not use, 429 over a key's or a deployment's
requests per minute, 413 over the configured body size, ``/health`` open, a changed key file
taking effect within seconds without a restart, and the access log and metrics by key name.

The session's ``atomr serve`` app is re-deployed with a key file, two ingress replicas and a
1 MiB body limit for this module (Serve runs one HTTP proxy per cluster, so a second server
cannot run beside it), then as it was again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import REPLICA_WAIT_S

pytestmark = pytest.mark.e2e
ATOMR = Path(sys.executable).parent / "atomr"
ALICE, BOB, CAROL, DAVE = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789", "sk-dave-0123456789"
ERIN, FRANK, GRACE, HEIDI = "sk-erin-0123456789", "sk-frank-0123456789", "sk-grace-0123456789", "sk-heidi-0123456789"
IVAN, JUDY = "sk-ivan-0123456789", "sk-judy-0123456789"
KEYS = f"""
keys:
  - name: alice
    key: {ALICE}
  - name: bob
    key: {BOB}
    deployments: [smollm2]
  - name: dave
    key: {DAVE}
    requests_per_minute: 3
  - name: erin
    key: {ERIN}
    tokens_per_minute: 30
  - name: frank
    key: {FRANK}
    tokens_per_minute: 30
  - name: grace
    key: {GRACE}
    tokens_per_minute: 30
  - name: heidi
    key: {HEIDI}
    tokens_per_minute: 30
  - name: ivan
    key: {IVAN}
    tokens_per_minute: 30
  - name: judy
    key: {JUDY}
    requests_per_minute: 100
"""
ASK = [{"role": "user", "content": "What is the capital of France?"}]
MAX_BODY = 1 << 20  # configured for this module (the default is 16 MiB)
PAGE = "https://app.example"  # the one origin whose web pages may call it, for this module


@pytest.fixture(scope="module")
def keyed(openai_server, smollm2, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The API with ``KEYS`` in effect, and web pages of ``PAGE`` allowed (CORS); its URL and the key file."""
    from atomr_infer.serve import run_server
    from atomr_infer.serve.cors import Cors

    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEYS)
    host, port = "127.0.0.1", int(openai_server.url.rsplit(":", 1)[1])
    # Two ingress replicas: a limit must hold across them (one budget, not one per replica).
    run_server(
        host, port, blocking=True, replica_wait_s=REPLICA_WAIT_S, api_keys_path=str(path), num_replicas=2,
        max_body_bytes=MAX_BODY, cors=Cors(allowed_origins=(PAGE,)),
    )
    try:
        yield openai_server.url, path
    finally:  # the session's server again: no keys
        run_server(host, port, blocking=True, replica_wait_s=REPLICA_WAIT_S)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_valid_key_is_served_streaming_or_not(keyed):
    url, _ = keyed
    reply = client(url, ALICE).chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content
    stream = client(url, BOB).chat.completions.create(model="smollm2", messages=ASK, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_no_key_or_a_wrong_key_is_401_with_an_openai_error(keyed):
    url, _ = keyed
    with pytest.raises(openai.AuthenticationError) as info:
        client(url, "sk-wrong-0123456789").chat.completions.create(model="smollm2", messages=ASK, max_tokens=4)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    bare = httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2", "messages": ASK}, timeout=30)
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["code"] == "missing_api_key"
    models = httpx.get(f"{url}/v1/models", timeout=30)
    assert models.status_code == 401


def test_a_deployment_the_key_may_not_use_is_403_and_not_listed(keyed):
    url, _ = keyed
    with pytest.raises(openai.PermissionDeniedError) as info:
        client(url, BOB).chat.completions.create(model="other", messages=ASK, max_tokens=4)
    assert info.value.status_code == 403 and "'bob' may not use deployment 'other'" in info.value.message
    with pytest.raises(openai.NotFoundError):  # a key without a list: the deployment does not exist
        client(url, ALICE).chat.completions.create(model="other", messages=ASK, max_tokens=4)
    assert [m.id for m in client(url, BOB).models.list()] == ["smollm2"]
    assert "smollm2" in [m.id for m in client(url, ALICE).models.list()]


def test_a_key_limited_to_3_requests_per_minute_gets_the_fourth_refused_with_retry_after(keyed):
    url, _ = keyed
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {DAVE}"}
    # Over two ingress replicas (the proxy spreads requests): budgets per replica would pass all 4.
    answers = [httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429], [a.text for a in answers]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0", "0"]
    refused = answers[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 20 and refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):  # as the openai client sees it
        client(url, DAVE).chat.completions.create(**body)


def test_health_stays_open(keyed):
    url, _ = keyed
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_a_changed_key_file_takes_effect_within_seconds(keyed):
    url, path = keyed
    path.write_text(KEYS + f"  - name: carol\n    key: {CAROL}\n")
    later = time.time() + 2  # a later mtime, however coarse the filesystem's clock
    os.utime(path, (later, later))
    carol = {"Authorization": f"Bearer {CAROL}"}
    started, in_a_row = time.monotonic(), 0
    # Accepted by both ingress replicas: each re-reads the file on its own (on a request, at
    # most once a second), so wait for several answers in a row.
    while in_a_row < 6 and time.monotonic() - started < 15:
        ok = httpx.get(f"{url}/v1/models", headers=carol, timeout=30).status_code == 200
        in_a_row = in_a_row + 1 if ok else 0
        time.sleep(0.3)
    assert in_a_row == 6, f"carol's key not accepted {time.monotonic() - started:.0f}s after the change"
    path.write_text("keys: [{name: broken}]")  # a bad file keeps the keys it had
    os.utime(path, (later + 2, later + 2))
    time.sleep(2.5)
    assert [httpx.get(f"{url}/v1/models", headers=carol, timeout=30).status_code for _ in range(6)] == [200] * 6


def test_serve_with_a_bad_key_file_fails_in_one_line_before_starting(tmp_path):
    bad = tmp_path / "keys.yaml"
    bad.write_text("keys: [{name: a, key_sha256: xyz}]")
    proc = subprocess.run(
        [str(ATOMR), "serve", "--api-keys", str(bad), "--address", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "NO_COLOR": "1"},
    )
    assert proc.returncode == 2, proc.stderr  # a usage error: the flag's file
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: --api-keys: api keys file '{bad}': keys.0: key_sha256 must be 64 hex digits "
                     "(sha256sum of the key)"]


def test_a_deployment_rate_limit_changes_in_place_and_holds_for_every_key(keyed, manager, ray_cluster):
    from tests.conftest import smollm2_spec

    url, _ = keyed
    base = smollm2_spec()
    limited = smollm2_spec(serving={**base.serving.model_dump(), "rate_limits": {"requests_per_minute": 2}})
    result = ray_cluster.get(manager.apply.remote(limited))
    assert result.actions == ("update in place (serving.rate_limits.requests_per_minute: unset → 2)",)
    try:
        body = {"model": "smollm2", "messages": ASK, "max_tokens": 1}
        statuses = []
        for key in (ALICE, BOB, ALICE, BOB, ALICE, BOB):  # two keys, one deployment budget
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=60)
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                break
        assert statuses[-1] == 429, statuses  # within a few requests of the table reaching the ingress
        assert "deployment 'smollm2' is over its limit of 2 requests per minute" in answer.json()["error"]["message"]
        assert int(answer.headers["retry-after"]) >= 1
    finally:
        ray_cluster.get(manager.apply.remote(base))
        # The limit is gone once the new table reaches both ingress replicas (each caches it by
        # long poll): the next test's first request must not meet the old limit (a fresh-clone
        # run failed so). Requests refused meanwhile consume nothing.
        deadline, passed = time.monotonic() + 30, 0
        while passed < 4 and time.monotonic() < deadline:
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {BOB}"},
                                timeout=60)
            passed = passed + 1 if answer.status_code == 200 else 0
            if not passed:
                time.sleep(0.2)


def test_every_request_has_an_access_log_line_and_counts_by_key_name(keyed):
    import glob
    import json

    import ray

    from tests.integration.test_metrics import poll, total

    url, _ = keyed
    reply = client(url, ALICE).chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=5)
    used = reply.usage.total_tokens
    httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2", "messages": ASK}, timeout=30)  # 401
    logs_dir = ray._private.worker.global_worker.node.get_logs_dir_path()

    def access_lines() -> list[dict]:
        out = []
        for path in glob.glob(f"{logs_dir}/worker-*.err"):
            with open(path, errors="replace") as f:
                out += [json.loads(ln) for ln in f if ln.startswith("{") and '"api_request"' in ln]
        return out

    deadline, lines = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        lines = access_lines()
        if any(x["key"] == "alice" and x.get("tokens") == used for x in lines) and any(
            x["status"] == 401 for x in lines
        ):
            break
        time.sleep(0.5)
    ours = next(x for x in lines if x["key"] == "alice" and x.get("tokens") == used)
    assert ours["deployment"] == "smollm2" and ours["status"] == 200 and ours["latency_ms"] > 0, ours
    refused = next(x for x in lines if x["status"] == 401)
    assert refused["key"] == "-" and refused["deployment"] == "-", refused  # refused before its body was read
    assert not any(ALICE in json.dumps(x) for x in lines)  # the key itself is never logged
    poll(lambda s: total(s, "ray_atomr_api_tokens_total", key="alice", deployment="smollm2") >= used,
         "alice's tokens in ray_atomr_api_tokens_total")
    series = poll(lambda s: total(s, "ray_atomr_api_requests_total", key="-", status="401") >= 1,
                  "the 401 in ray_atomr_api_requests_total")
    assert total(series, "ray_atomr_api_requests_total", key="alice", deployment="smollm2", status="200") >= 1


def test_a_body_over_the_configured_size_is_413_before_routing(keyed):
    url, _ = keyed
    big = {"model": "smollm2", "messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}
    resp = httpx.post(f"{url}/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
    assert resp.status_code == 413 and str(MAX_BODY) in resp.json()["error"]["message"], resp.text


def _until_refused(url: str, key: str, body: dict, tries: int = 4, path: str = "/v1/chat/completions",
                   ) -> list[httpx.Response]:
    """Requests until one is refused (the charge of the one before may reach the shared
    limiter a moment after the client has its answer)."""
    answers = []
    for _ in range(tries):
        answers.append(httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60))
        if answers[-1].status_code == 429:
            break
    return answers


def test_a_key_over_its_tokens_per_minute_is_refused_until_it_refills(keyed):
    url, _ = keyed
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 8}  # prompt + answer: more than 30 tokens
    answers = _until_refused(url, ERIN, body)
    first, refused = answers[0], answers[-1]
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 30
    assert first.headers["x-ratelimit-limit-tokens"] == "30" and first.headers["x-ratelimit-remaining-tokens"] == "30"
    assert refused.status_code == 429, [a.status_code for a in answers]
    assert "the API key 'erin' is over its limit of 30 tokens per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1


def test_a_stream_is_charged_the_usage_its_client_did_not_ask_to_see(keyed):
    url, _ = keyed
    # continuous_usage_stats without include_usage: vLLM gives no usage; nor does the charged stream
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    answers = _until_refused(url, FRANK, body)
    first = answers[0]
    assert first.status_code == 200 and first.text.rstrip().endswith("data: [DONE]")
    assert '"usage":{' not in first.text.replace(" ", ""), first.text[-300:]  # hidden again
    assert answers[-1].status_code == 429, [a.status_code for a in answers]


def test_a_stream_sent_as_stream_1_is_charged_and_a_background_response_refused(keyed):
    """vLLM streams "stream": 1 (pydantic reads it as true); the ingress read it as no stream and
    charged nothing. A background response is answered before it runs, with no usage to charge."""
    url, _ = keyed
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, "stream": 1}
    answers = _until_refused(url, IVAN, body)
    assert answers[0].status_code == 200 and answers[0].text.rstrip().endswith("data: [DONE]")
    assert answers[-1].status_code == 429, [a.status_code for a in answers]
    with pytest.raises(openai.BadRequestError) as info:
        client(url, HEIDI).responses.create(model="smollm2", input="Say hi.", max_output_tokens=8, store=True,
                                            background=True)
    assert info.value.param == "background" and "tokens_per_minute" in info.value.message


def test_a_lost_rate_limiter_is_replaced_and_limits_go_on(keyed, ray_cluster):
    """The limiter actor died (its process killed): every limited request got a 500 until the
    ingress restarted. Now Ray restarts it, or, killed for good, an ingress makes a new one."""
    import ray

    from atomr_infer.cluster import NAMESPACE
    from atomr_infer.serve.rate_limit import LIMITER_NAME

    url, _ = keyed
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {JUDY}"}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    for no_restart in (False, True):
        ray.kill(ray.get_actor(LIMITER_NAME, namespace=NAMESPACE), no_restart=no_restart)
        # a new connection each time: both ingress replicas meet the lost actor
        answers = [httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert all(int(a.headers["x-ratelimit-remaining-requests"]) < 100 for a in answers)


def test_anthropic_clients_authenticate_with_x_api_key(keyed):
    import anthropic

    url, _ = keyed
    ask = [{"role": "user", "content": "What is the capital of France?"}]

    def claude(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)

    assert claude(ALICE).messages.create(model="smollm2", max_tokens=8, messages=ask).content[0].text
    with pytest.raises(anthropic.AuthenticationError) as info:
        claude("sk-wrong-0123456789").messages.create(model="smollm2", max_tokens=8, messages=ask)
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        claude(BOB).messages.create(model="other", max_tokens=8, messages=ask)
    assert denied.value.body["error"]["type"] == "permission_error"
    # The same key as a bearer token, on an OpenAI route: x-api-key is only another way to send it.
    headers = {"x-api-key": ALICE}
    answer = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                        json={"model": "smollm2", "messages": ask, "max_tokens": 4})
    assert answer.status_code == 200, answer.text


def test_a_stored_response_is_found_through_every_ingress_replica(keyed):
    """Two ingress replicas share no state: the response's id says which engine replica holds it."""
    url, _ = keyed
    stored = client(url, ALICE).responses.create(model="smollm2", input="Say hi.", max_output_tokens=8, store=True)
    for _ in range(8):  # a new connection each time: the kernel spreads them over both replicas
        found = httpx.get(f"{url}/v1/responses/{stored.id}", headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
        assert found.status_code == 200 and found.json()["id"] == stored.id, found.text
    nobody = httpx.get(f"{url}/v1/responses/{stored.id}", headers={"x-api-key": "sk-nobody-01234"}, timeout=60)
    assert nobody.status_code == 401  # a stored response is behind the keys, as every routed route
    for unknown in (httpx.get(f"{url}/v1/responses/resp_abc", timeout=60),  # nothing said of an id without a key
                    httpx.post(f"{url}/v1/responses/resp_abc/cancel", timeout=60)):
        assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "missing_api_key", unknown.text


@pytest.mark.parametrize("key, path, stream", [(GRACE, "/v1/messages", True), (HEIDI, "/v1/responses", False)])
def test_messages_and_responses_are_charged_their_usage(keyed, key, path, stream):
    """A Messages stream and a Responses answer report their usage in their own shapes: both are
    charged, and the next request over the key's 30 tokens a minute is refused (in Anthropic's
    error shape on /v1/messages)."""
    url, _ = keyed
    body = {"model": "smollm2", "max_tokens": 8, "messages": ASK, "stream": stream} if path == "/v1/messages" else {
        "model": "smollm2", "max_output_tokens": 8, "input": ASK[0]["content"]}
    answers = _until_refused(url, key, body, path=path)
    assert answers[0].status_code == 200 and answers[-1].status_code == 429, [a.status_code for a in answers]
    refused = answers[-1].json()
    if path == "/v1/messages":
        assert refused["type"] == "error" and refused["error"]["type"] == "rate_limit_error", refused
    else:
        assert refused["error"]["code"] == "rate_limit_exceeded", refused


def test_a_page_of_the_allowed_origin_is_answered_before_and_after_the_key_check(keyed):
    """A browser's preflight carries no key: CORS answers it before the key check, for the
    allowed origin only; the answers to the request itself (401 too) carry what the browser needs
    to hand them to the page."""
    url, _ = keyed
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    allowed = httpx.options(f"{url}/v1/chat/completions", headers={"origin": PAGE, **preflight}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == PAGE
    other = httpx.options(f"{url}/v1/chat/completions", headers={"origin": "https://other.example", **preflight},
                          timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 4}
    keyed_post = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                            headers={"origin": PAGE, "authorization": f"Bearer {ALICE}"})
    assert keyed_post.status_code == 200 and keyed_post.headers["access-control-allow-origin"] == PAGE
    bare = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"origin": PAGE}, timeout=30)
    assert bare.status_code == 401 and bare.headers["access-control-allow-origin"] == PAGE


def test_atomr_up_adding_an_origin_to_the_running_api_keeps_its_keys(keyed, ray_cluster):
    """`atomr up --serve --allowed-origins` updates the API in place: what it is not given (the
    keys, the body limit) stays as the API runs with it. It dropped the keys (and served all)."""
    url, path = keyed
    path.write_text(KEYS)  # (tests above leave it in other states)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("RAY_ADDRESS", None)
    address = ray_cluster.get_runtime_context().gcs_address
    other = "https://other.example"
    proc = subprocess.run([str(ATOMR), "up", "--serve", "--host", host, "--port", port, "--address", address,
                           "--no-gemma", "--allowed-origins", f"{PAGE},{other}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 4}
    bare = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"origin": other}, timeout=30)
    assert bare.status_code == 401, bare.text  # still keyed
    assert bare.headers["access-control-allow-origin"] == other  # and the new origin allowed
    big = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (MAX_BODY + 1),
                     headers={"authorization": f"Bearer {ALICE}", "content-type": "application/json"}, timeout=30)
    assert big.status_code == 413  # the body limit kept too
