"""VllmReplica on real Ray and real vLLM (CPU backend) with the bundled SmolLM2."""

from __future__ import annotations

import concurrent.futures

import pytest
import ray
from transformers import AutoTokenizer

from atomr_infer.errors import EngineError, ReplicaUnavailable, unwrap
from tests.replica_http import http_request, run
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


CHAT = "/v1/chat/completions"


def chat(replica, body: dict):
    return run(replica, {"messages": CAPITAL, **body}, CHAT)


def test_chat_round_trip_mentions_paris(smollm2_replica):
    answer = chat(smollm2_replica, {"temperature": 0, "max_tokens": 32})
    assert answer.status == 200 and "Paris" in answer.text
    assert answer.finish_reason == "stop"


def test_completion_round_trip(smollm2_replica):
    answer = run(smollm2_replica, {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 8,
                                   "return_token_ids": True})
    assert answer.text.strip()
    assert answer.usage["completion_tokens"] == len(answer.token_ids) <= 8


def test_usage_counts_match_the_tokenizer(smollm2_replica, bundled_model_dir):
    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    rendered = tok.apply_chat_template(CAPITAL, tokenize=False, add_generation_prompt=True)
    expected_prompt = len(tok.encode(rendered, add_special_tokens=False))
    answer = chat(smollm2_replica, {"temperature": 0, "max_tokens": 16, "return_token_ids": True})
    assert answer.usage["prompt_tokens"] == expected_prompt
    assert answer.usage["completion_tokens"] == len(answer.token_ids)


def test_max_tokens_gives_length_and_stop_string_gives_stop(smollm2_replica):
    answer = chat(smollm2_replica, {"temperature": 0, "max_tokens": 3})
    assert answer.finish_reason == "length" and answer.usage["completion_tokens"] == 3
    answer = chat(smollm2_replica, {"temperature": 0, "max_tokens": 32, "stop": ["Paris"]})
    assert answer.finish_reason == "stop"
    assert "Paris" not in answer.text and "capital" in answer.text.lower()


def test_32_concurrent_streams_each_get_their_own_output(smollm2_replica, bundled_model_dir):
    # Batched and unbatched greedy outputs may differ (native bf16 kernels round differently
    # at other batch sizes), so the oracle is not "the same text as alone". It is what only
    # this request can produce: its own length (each asks for a different max_tokens, past
    # EOS), its own usage, and text that is exactly its own tokens decoded.
    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    prompts = [f"Write the number {i} in words, then count up from {i}." for i in range(32)]

    def request(i):
        body = {"prompt": prompts[i], "temperature": 0, "max_tokens": 4 + i, "ignore_eos": True}
        return run(smollm2_replica, {**body, "return_token_ids": True})

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(request, range(32)))
    for i, answer in enumerate(results):
        assert len(answer.token_ids) == 4 + i, (i, len(answer.token_ids))
        assert answer.finish_reason == "length"
        assert answer.usage["completion_tokens"] == 4 + i
        assert answer.usage["prompt_tokens"] == len(tok.encode(prompts[i]))
        assert answer.text == tok.decode(answer.token_ids, skip_special_tokens=True), i
    assert len({answer.text for answer in results}) > 16  # the prompts really produce different texts


def test_cancel_aborts_the_request_in_the_engine(smollm2_replica):
    body = {"messages": CAPITAL, "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    gen = smollm2_replica.http.remote(http_request(CHAT, body))
    for _ in range(3):
        ray.get(next(gen))
    before = ray.get(smollm2_replica.stats.remote())
    assert before.in_flight >= 1 and before.engine_unfinished >= 1
    ray.cancel(gen)
    after = wait_until(lambda: (s := ray.get(smollm2_replica.stats.remote())).engine_unfinished == 0 and s, 10,
                       what="the abort reaching the engine")
    assert after.in_flight == 0
    assert after.requests_aborted == before.requests_aborted + 1


@pytest.mark.parametrize(
    "request_, field",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({}, "prompt"),
        ({"prompt": "word " * 3000, "max_tokens": 4}, "2048"),
        ({"prompt": "hi", "max_tokens": 5000}, "5000"),
    ],
)
def test_bad_request_fails_alone_with_the_field_named(smollm2_replica, request_, field):
    ok = smollm2_replica.http.remote(http_request(CHAT, {"messages": CAPITAL, "temperature": 0, "max_tokens": 24}))
    answer = run(smollm2_replica, request_)
    assert answer.status == 400, answer.body[:300]
    assert field in answer.error["message"] or answer.error.get("param") == field, answer.error
    assert "Paris" in b"".join(ray.get(ref) for ref in list(ok)[1:]).decode()  # the other request is unaffected


def test_broken_engine_errors_every_stream_and_fails_health(ray_cluster, bundled_model_dir):
    import cloudpickle

    from atomr_infer.engine.vllm.backend import VllmBackend
    from atomr_infer.replica import replica_actor_class
    from tests.integration import broken_engine

    from .conftest import smollm2_spec

    cloudpickle.register_pickle_by_value(broken_engine)
    factory = broken_engine.broken_engine_factory(str(bundled_model_dir), fail_after_steps=3)
    backend = VllmBackend.factory(factory)
    actor = replica_actor_class().options(num_cpus=0).remote(smollm2_spec(name="broken"), "r0", backend)
    try:
        ray.get(actor.ready.remote(300))
        assert ray.get(actor.health.remote()).state == "ready"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            bodies = [{"model": "broken", "prompt": f"p{i}", "max_tokens": 100} for i in range(3)]
            answers = list(pool.map(lambda body: run(actor, body), bodies))
        for answer in answers:  # vLLM's server reports the engine's failure: in-band, or as a 500
            said = answer.body.decode()
            assert "simulated engine crash" in said or "EngineDeadError" in said or answer.status >= 500, said[-500:]
            assert answer.finish_reason != "length"
        with pytest.raises(Exception) as info:
            ray.get(actor.health.remote())
        assert isinstance(unwrap(info.value), EngineError)
        # New requests are refused rather than left hanging.
        with pytest.raises(Exception) as info:
            run(actor, {"model": "broken", "prompt": "again", "max_tokens": 5})
        err = unwrap(info.value)
        assert isinstance(err, ReplicaUnavailable) and "unhealthy" in str(err)  # the router tries another
    finally:
        ray.kill(actor)


def test_dashboard_shows_name_and_readable_repr(smollm2_replica, dashboard_url):
    from ray.util.state import get_actor

    state = get_actor(smollm2_replica._actor_id.hex(), address=dashboard_url)
    assert state.name == "atomr:smollm2:r0"
    assert state.repr_name == "atomr:smollm2:r0 (cpu)"
    info = ray.get(smollm2_replica.ready.remote())
    assert info["device"] == "cpu" and info["replica_id"] == "r0"


def test_on_cpu_the_engine_core_runs_inside_the_replica_process(smollm2_replica, dashboard_url):
    import psutil
    from ray.util.state import get_actor

    pid = get_actor(smollm2_replica._actor_id.hex(), address=dashboard_url).pid
    assert psutil.Process(pid).name().startswith("ray::VllmReplic")
    children = [p.name() for p in psutil.Process(pid).children(recursive=True)]
    assert not [name for name in children if name.startswith("VLLM::")], children  # no EngineCore process
