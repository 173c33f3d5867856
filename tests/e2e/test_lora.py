"""LoRA adapters over real HTTP, on two replicas of the bundled model: adapters made at test
time with ``peft`` (tests/lora_adapters.py) answer with their own phrase where the base model
does not; an adapter added to the spec is loaded by both running replicas (the same actors)
within seconds, one removed answers 404 naming it, and ``/v1/models`` lists them with their
parent. The Client names them as HTTP does."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import smollm2_spec
from tests.lora_adapters import PHRASES, RANK, adapter_dir

pytestmark = pytest.mark.e2e
NAME = "tuned"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapters(bundled_model_dir) -> dict[str, str]:
    return {name: str(adapter_dir(bundled_model_dir, name)) for name in PHRASES}


def tuned_spec(adapters: dict[str, str]):
    lora = {"adapters": adapters, "max_loras": 2, "max_lora_rank": RANK}
    return smollm2_spec(name=NAME, replicas=2, lora=lora)


def loaded(manager, ray_cluster) -> list[dict[str, str]]:
    status = ray_cluster.get(manager.status.remote(NAME))
    return [r.adapters for r in status.replicas if r.state == "ready"]


def wait_loaded(manager, ray_cluster, names: set[str], timeout_s: float) -> float:
    started = time.monotonic()
    while True:
        states = loaded(manager, ray_cluster)
        if len(states) == 2 and all({a for a, s in st.items() if s == "loaded"} == names for st in states):
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, states
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tuned(adapters, manager, ray_cluster, openai_server) -> Iterator[str]:
    ray_cluster.get(manager.apply.remote(tuned_spec({"pirate": adapters["pirate"]})))
    status = ray_cluster.get(manager.wait_ready.remote(NAME, 600))
    assert status is not None and status.replicas_ready == 2, status
    wait_loaded(manager, ray_cluster, {"pirate"}, 60)
    yield openai_server.url
    ray_cluster.get(manager.remove.remote(NAME))


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": ASK, "max_tokens": 16, "temperature": 0})


def text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def test_the_adapter_answers_unlike_the_base_model(tuned):
    base, pirate = text(chat(tuned, NAME)), text(chat(tuned, f"{NAME}:pirate"))
    assert pirate.startswith("Arr matey") and not base.startswith("Arr"), (base, pirate)
    assert text(chat(tuned, "pirate")) == pirate  # the bare name: no other deployment has one so named
    models = {m["id"]: m for m in httpx.get(f"{tuned}/v1/models", timeout=30).json()["data"]}
    assert models[f"{NAME}:pirate"]["parent"] == NAME


def test_an_adapter_added_is_served_by_every_replica_in_place_and_one_removed_is_404(
    tuned, adapters, manager, ray_cluster
):
    actors = sorted(r.actor_id for r in ray_cluster.get(manager.status.remote(NAME)).replicas)
    result = ray_cluster.get(manager.apply.remote(tuned_spec(adapters)))
    assert [a.split(" (")[0] for a in result.actions] == ["update in place"], result.actions
    took = wait_loaded(manager, ray_cluster, {"pirate", "robot"}, 10)
    for _ in range(6):  # both replicas serve it (power of two spreads six requests)
        assert text(chat(tuned, f"{NAME}:robot")).startswith("BEEP BOOP"), took
    assert sorted(r.actor_id for r in ray_cluster.get(manager.status.remote(NAME)).replicas) == actors

    ray_cluster.get(manager.apply.remote(tuned_spec({"robot": adapters["robot"]})))
    wait_loaded(manager, ray_cluster, {"robot"}, 10)
    gone = chat(tuned, f"{NAME}:pirate")
    assert gone.status_code == 404 and "no adapter 'pirate'" in gone.json()["error"]["message"], gone.text


def test_the_client_names_an_adapter_as_http_does(tuned, manager):
    from atomr_infer import Client

    client = Client(manager=manager)
    try:
        reply = client.chat(f"{NAME}:robot", ASK, max_tokens=16, temperature=0)
    finally:
        client.close()
    assert reply.choices[0].message.content.startswith("BEEP BOOP")
