"""A replica killed (SIGKILL) under 32 concurrent streams on two real replicas: every stream goes
on on the other replica and ends with its finish_reason and its full token count; chat and
completions, over HTTP (the openai client) and through the ``Client``; non-streaming requests
are re-run whole. Then a resumed request answered by a replica directly: its usage is the whole
answer's and its chat stream opens as any does."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import smollm2_spec

pytestmark = pytest.mark.e2e
NAME = "moving"
TOKENS = 160  # long enough that the streams are mid-way when the last of them start, on a fast CPU
ASK = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture(scope="module")
def moving(manager, ray_cluster, openai_server) -> Iterator[str]:
    ray_cluster.get(manager.apply.remote(smollm2_spec(name=NAME, replicas=2)))
    status = ray_cluster.get(manager.wait_ready.remote(NAME, 600))
    assert status is not None and status.replicas_ready == 2, status
    yield openai_server.url
    ray_cluster.get(manager.remove.remote(NAME))


class Load:
    """Streams run in threads; each records its chunks' arrival times and what it ended with."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)  # released once per stream that has its first tokens
        self.results: list[dict] = []
        self.errors: list[tuple[str, BaseException]] = []
        self.lock = threading.Lock()

    def run(self, fn, *args) -> threading.Thread:
        def body() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the test reports every failure
                with self.lock:
                    self.errors.append((fn.__name__, exc))
                self.started.release()
                return
            with self.lock:
                self.results.append(result)

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread

    def consume(self, chunks, kind: str) -> dict:
        times, finish, usage, pieces = [], None, None, 0
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = choice.delta.content if kind == "chat" else choice.text
            if text:
                times.append(time.monotonic())
                pieces += 1
                if pieces == 3:
                    self.started.release()
            finish = choice.finish_reason or finish
        return {"kind": kind, "finish": finish, "usage": usage, "times": times}


def test_a_replica_killed_under_32_streams_loses_none(moving, manager, ray_cluster):
    from ray.util.state import get_actor

    from atomr_infer import Client

    url, load = moving, Load()
    http = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600)
    client = Client(manager=manager)
    common = {"max_tokens": TOKENS, "temperature": 0.8, "extra_body": {"ignore_eos": True},
              "stream_options": {"include_usage": True}}

    def http_chat() -> dict:
        return load.consume(http.chat.completions.create(model=NAME, messages=ASK, stream=True, **common), "chat")

    def http_completion() -> dict:
        stream = http.completions.create(model=NAME, prompt="Once upon a time", stream=True, **common)
        return load.consume(stream, "completion")

    def client_chat() -> dict:
        chunks = client.stream_chat(NAME, ASK, max_tokens=TOKENS, temperature=0.8, ignore_eos=True,
                                    stream_options={"include_usage": True})
        return load.consume(chunks, "chat")

    def whole() -> dict:
        reply = http.chat.completions.create(model=NAME, messages=ASK, max_tokens=TOKENS,
                                             extra_body={"ignore_eos": True})
        return {"kind": "whole", "finish": reply.choices[0].finish_reason, "usage": reply.usage, "times": []}

    streams = [http_chat] * 12 + [http_completion] * 12 + [client_chat] * 8
    threads = [load.run(fn) for fn in streams]
    for _ in range(28):  # most streams have their first tokens: each replica is mid-way through many
        assert load.started.acquire(timeout=600)
    threads += [load.run(whole) for _ in range(4)]
    replicas = ray_cluster.get(manager.status.remote(NAME)).replicas
    serving = {r.actor_id: ray_cluster.get(ray_cluster.get_actor(r.actor_name, namespace="atomr").in_flight.remote())
               for r in replicas}
    victim = max(serving, key=serving.get)
    assert serving[victim] >= 4, serving  # the kill cuts streams mid-way
    os.kill(get_actor(victim).pid, signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=900)
    client.close()

    assert not load.errors, load.errors
    assert len(load.results) == 36
    for result in load.results:  # the whole answer, however it was served
        assert result["finish"] == "length", result
        assert result["usage"].completion_tokens == TOKENS, result
    # The gap each stream had across the kill (a moved stream's includes its move), for the note.
    gaps = sorted(b - a for r in load.results for a, b in zip(r["times"], r["times"][1:], strict=False)
                  if a <= killed <= b)
    print(f"\n{serving[victim]} streams on the killed replica; gap across the kill over {len(gaps)} streams: "
          f"p50 {gaps[len(gaps) // 2] * 1000:.0f} ms, max {gaps[-1] * 1000:.0f} ms")


def test_a_resumed_request_answers_the_whole_answers_usage(moving, manager, ray_cluster):
    """Straight to a replica, as a router resumes: the prompt is counted as asked and the
    completion counts the tokens it resumed after; the budget is the whole answer's."""
    import asyncio
    import json

    from atomr_infer.routing.channel import ReplicaChannel
    from atomr_infer.wire import HttpHead, HttpRequest, OpenRequest

    replica = next(r for r in ray_cluster.get(manager.status.remote(NAME)).replicas if r.state == "ready")
    actor = ray_cluster.get_actor(replica.actor_name, namespace="atomr")
    body = {"model": NAME, "messages": ASK, "max_tokens": 8, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    request = HttpRequest("POST", "/v1/chat/completions", (("content-type", "application/json"),),
                          json.dumps(body).encode())

    async def answer(resume):
        channel = ReplicaChannel(actor)
        try:
            items = [i async for i in channel.request(OpenRequest("", request, None, None, False, resume))]
        finally:
            await asyncio.gather(*channel.close(), return_exceptions=True)
        events = b"".join(i for i in items if not isinstance(i, HttpHead)).split(b"\n\n")
        chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        return chunks[-1]["usage"], text

    whole, _ = asyncio.run(answer(None))
    resumed, text = asyncio.run(answer([791, 6185, 314]))  # " The dragon was" as SmolLM2 tokenizes it, say
    assert resumed["prompt_tokens"] == whole["prompt_tokens"]  # the prompt as asked
    assert resumed["completion_tokens"] == whole["completion_tokens"] == 8  # 3 resumed + 5 new
    assert text  # the continuation's text alone
