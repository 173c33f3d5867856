"""LoRA adapters over real HTTP, on two replicas of the bundled model: adapters made at test
time with ``peft`` (tests/lora_adapters.py) answer with their own phrase where the base model
does not; an adapter added to the spec is loaded by both running replicas (the same actors)
within seconds, one removed answers 404 naming it, and ``/v1/models`` lists them with their
parent; requests for the base model, an adapter and the one being added all succeed while it
loads. One adapter comes from a Hugging Face repo id, fetched by the replicas from the hub cache
(the Hub itself is out of reach here; huggingface_hub reads its cache for real). The Client names
them as HTTP does; a key limited to one adapter is refused another; ``atomr status`` shows each
replica's adapters."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import smollm2_spec
from tests.e2e.conftest import REPLICA_WAIT_S
from tests.lora_adapters import RANK, adapter_dir
from tests.unit.hub_cache import fake_snapshot

pytestmark = pytest.mark.e2e
NAME = "tuned"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
ROBOT_REPO = "atomr-test/smollm2-robot-lora"
PIRATE_ONLY = "sk-pirate-only-0123456789"


@pytest.fixture(scope="module")
def hub_cache(bundled_model_dir, tmp_path_factory) -> str:
    """A hub cache holding the robot adapter as the repository ``ROBOT_REPO``."""
    cache = tmp_path_factory.mktemp("hub")
    robot = adapter_dir(bundled_model_dir, "robot")
    fake_snapshot(cache, ROBOT_REPO, {f.name: f.read_bytes() for f in robot.iterdir() if f.is_file()})
    return str(cache)


@pytest.fixture(scope="module")
def adapters(bundled_model_dir, hub_cache) -> dict[str, str]:
    """The pirate from a local directory; the robot from a (cached) Hugging Face repo id."""
    return {"pirate": str(adapter_dir(bundled_model_dir, "pirate")), "robot": ROBOT_REPO}


@pytest.fixture(scope="module")
def tuned_spec(hub_cache):
    def spec(adapters: dict[str, str]):
        lora = {"adapters": adapters, "max_loras": 2, "max_lora_rank": RANK}
        runtime = {**smollm2_spec().runtime_config.model_dump(exclude_none=True), "hf_cache_dir": hub_cache}
        return smollm2_spec(name=NAME, replicas=2, lora=lora, runtime_config=runtime)

    return spec


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
def tuned(adapters, tuned_spec, manager, ray_cluster, openai_server) -> Iterator[str]:
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
    tuned, tuned_spec, adapters, manager, ray_cluster
):
    actors = sorted(r.actor_id for r in ray_cluster.get(manager.status.remote(NAME)).replicas)
    answers: dict[str, list[httpx.Response | Exception]] = {NAME: [], f"{NAME}:pirate": [], f"{NAME}:robot": []}
    applied, loading = threading.Event(), threading.Event()
    loading.set()

    def load(model: str) -> None:  # requests back to back while the adapter loads
        if model.endswith("robot"):
            applied.wait()  # asked for from the moment the apply returns
        while loading.is_set():
            try:
                answers[model].append(chat(tuned, model))
            except Exception as exc:  # noqa: BLE001 - a failed request, counted below
                answers[model].append(exc)

    threads = [threading.Thread(target=load, args=(model,)) for model in answers]
    for thread in threads:
        thread.start()
    try:
        result = ray_cluster.get(manager.apply.remote(tuned_spec(adapters)))
        applied.set()
        assert [a.split(" (")[0] for a in result.actions] == ["update in place"], result.actions
        took = wait_loaded(manager, ray_cluster, {"pirate", "robot"}, 10)
    finally:
        applied.set()
        loading.clear()
        for thread in threads:
            thread.join()
    # Zero failed requests while it loaded, the new adapter's own included (they waited for it).
    for model, got in answers.items():
        assert got and all(isinstance(a, httpx.Response) and a.status_code == 200 for a in got), \
            (model, [a if isinstance(a, Exception) else (a.status_code, a.text[:300]) for a in got])
    assert all(text(a).startswith("BEEP BOOP") for a in answers[f"{NAME}:robot"])
    print(f"adapter loaded on both replicas {took:.1f} s after the apply; served meanwhile:",
          {model: len(got) for model, got in answers.items()})
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


def test_atomr_status_shows_each_replicas_adapters(tuned, ray_cluster):
    address = ray_cluster.get_runtime_context().gcs_address
    command = [str(Path(sys.executable).parent / "atomr"), "status", NAME, "--address", address]
    shown = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    replicas = json.loads(shown.stdout)["replicas"]
    assert len(replicas) == 2 and all(r["adapters"] == {"robot": "loaded"} for r in replicas), replicas
    table = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and f"{NAME}/r0 adapters: robot loaded" in table.stdout, table.stdout


def test_a_key_limited_to_one_adapter_is_refused_another(tuned, tuned_spec, adapters, manager, ray_cluster,
                                                          openai_server, tmp_path):
    from atomr_infer.serve import run_server

    ray_cluster.get(manager.apply.remote(tuned_spec(adapters)))
    wait_loaded(manager, ray_cluster, {"pirate", "robot"}, 10)
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - name: pirate-only\n    key: {PIRATE_ONLY}\n    deployments: [{NAME}:pirate]\n")
    host, port = "127.0.0.1", int(tuned.rsplit(":", 1)[1])
    run_server(host, port, blocking=True, replica_wait_s=REPLICA_WAIT_S, api_keys_path=str(keys))
    try:
        def ask(model: str) -> httpx.Response:
            return httpx.post(f"{tuned}/v1/chat/completions", timeout=120,
                              headers={"Authorization": f"Bearer {PIRATE_ONLY}"},
                              json={"model": model, "messages": ASK, "max_tokens": 16, "temperature": 0})

        assert text(ask(f"{NAME}:pirate")).startswith("Arr matey")
        for other in (f"{NAME}:robot", "robot", NAME):
            refused = ask(other)
            assert refused.status_code == 403, (other, refused.text)
            assert refused.json()["error"]["code"] == "model_not_allowed", refused.text
    finally:  # the session's server again: no keys
        run_server(host, port, blocking=True, replica_wait_s=REPLICA_WAIT_S)


def test_an_adapter_given_a_new_source_serves_the_new_weights_on_every_replica(
    tuned, tuned_spec, adapters, bundled_model_dir, manager, ray_cluster
):
    """Reloaded in place (the same name, the same replicas), then served from the engine's copy:
    vLLM kept the reload's request, which re-read the adapter from disk on every step."""
    robot_dir = str(adapter_dir(bundled_model_dir, "robot"))
    ray_cluster.get(manager.apply.remote(tuned_spec({"pirate": robot_dir, "robot": adapters["robot"]})))
    deadline, answers = time.monotonic() + 60, []
    while len(answers) < 6 or not all(a.startswith("BEEP BOOP") for a in answers[-6:]):  # six in a row:
        assert time.monotonic() < deadline, answers  # both replicas (power of two spreads them)
        answers.append(text(chat(tuned, f"{NAME}:pirate")))
    wait_loaded(manager, ray_cluster, {"pirate", "robot"}, 30)


def test_a_request_for_an_adapter_every_replica_failed_to_load_is_404_at_once_saying_why(
    tuned, tuned_spec, adapters, ray_cluster, tmp_path
):
    """It waited out the replica wait, then answered 503 "no ready replica" (with Retry-After);
    and ``atomr deploy`` (which waits) said ready, exit 0."""
    import yaml

    spec = tuned_spec({"robot": adapters["robot"], "ghost": "atomr-test/no-such-lora"})
    path = tmp_path / "tuned.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=True)))
    address = ray_cluster.get_runtime_context().gcs_address
    deploy = subprocess.run([str(Path(sys.executable).parent / "atomr"), "deploy", str(path), "--address", address,
                             "--timeout", "120"], capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 1, deploy.stdout + deploy.stderr
    assert "adapter 'ghost' failed to load" in deploy.stderr and "no-such-lora" in deploy.stderr, deploy.stderr
    answer = chat(tuned, f"{NAME}:ghost")
    assert answer.status_code == 404, answer.text
    message = answer.json()["error"]["message"]
    assert "'ghost' of deployment 'tuned' failed to load on every ready replica" in message, message
    assert "no-such-lora" in message, message
    assert text(chat(tuned, f"{NAME}:robot")).startswith("BEEP BOOP")  # the rest is served


def test_a_stream_running_with_an_adapter_an_apply_removes_ends_whole_and_the_replicas_stay_ready(
    tuned, tuned_spec, adapters, bundled_model_dir, manager, ray_cluster, tmp_path
):
    """The replica freed the engine's copy under the running request, and the worker loaded it
    again from disk inside the next step: with its directory gone, the step failed, and with it
    every open request of the replica, the base model's too."""
    import shutil

    doomed = tmp_path / "doomed"
    shutil.copytree(adapter_dir(bundled_model_dir, "pirate"), doomed)
    ray_cluster.get(manager.apply.remote(tuned_spec({"robot": adapters["robot"], "doomed": str(doomed)})))
    wait_loaded(manager, ray_cluster, {"robot", "doomed"}, 30)
    body = {"model": f"{NAME}:doomed", "messages": ASK, "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{tuned}/v1/chat/completions", json=body, timeout=300) as answer:
        events = answer.iter_lines()
        assert answer.status_code == 200 and next(events).startswith("data: ")  # running
        ray_cluster.get(manager.apply.remote(tuned_spec({"robot": adapters["robot"]})))
        shutil.rmtree(doomed)  # a normal clean-up, once the spec no longer names it
        time.sleep(5)  # two health checks: both replicas heard of it and unloaded it
        status = ray_cluster.get(manager.status.remote(NAME))
        assert sum(r.in_flight for r in status.replicas) >= 1, status  # it still ran, after the unload
        rest = [line for line in events if line.startswith("data: ")]
    usage = json.loads(rest[-2][6:]).get("usage") or {}  # without it: an error event (the engine failed)
    assert rest[-1] == "data: [DONE]" and usage.get("completion_tokens") == 1500, rest[-3:]
    assert chat(tuned, f"{NAME}:doomed").status_code == 404
    assert text(chat(tuned, NAME))
    status = ray_cluster.get(manager.status.remote(NAME))
    assert [r.state for r in status.replicas] == ["ready", "ready"], status
