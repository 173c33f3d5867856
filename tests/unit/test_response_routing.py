"""Stored Responses-API responses without shared state: the router names a new response after
the replica it picks, and routes a request naming one to that replica (routing/response_ids.py);
the replica's store is bounded (engine/vllm/response_store.py). Routing runs over fake replicas
and the real ``ChannelHub``; tests/e2e covers the real path (two ingress replicas, vLLM's store)."""

from __future__ import annotations

import asyncio
import json

from atomr_infer.engine.vllm.response_store import StoreIndex
from atomr_infer.routing import response_ids
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.wire import HttpHead, HttpRequest, RoutingFacts

from .fakes import JSON, FakeReplica, answer, route


class EchoReplica(FakeReplica):
    """Answers with its name and the request_id the body it got carries."""

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        put(HttpHead(200, JSON))
        put(json.dumps({"replica": self.name, "request_id": json.loads(request.body).get("request_id")}).encode())


def responses_request(**fields) -> tuple[RoutingFacts, HttpRequest]:
    data = {"model": "d", "input": "hi", **fields}
    return RoutingFacts.of("/v1/responses", data), HttpRequest("POST", "/v1/responses", JSON, json.dumps(data).encode())


def served(replicas, facts_and_request, times: int = 1) -> list[dict]:
    table = RoutingTable(1, {"d": DeploymentRoute("d", 64, "queue", tuple(route(r) for r in replicas))})

    async def source(version):
        return table if version != table.version else None

    async def main():
        router = Router(source, refresh_s=0.0)
        return [json.loads((await answer(router.stream(*facts_and_request)))[1]) for _ in range(times)]

    return asyncio.run(main())


def test_a_new_response_is_named_after_the_replica_that_makes_it():
    for answer_ in served([EchoReplica("r0"), EchoReplica("r1")], responses_request(), times=10):
        where = response_ids.home(answer_["request_id"])
        assert where == ("d", answer_["replica"]), answer_


def test_a_request_naming_a_stored_response_goes_to_its_replica():
    previous = response_ids.mint("d", "r1")
    answers = served([EchoReplica("r0"), EchoReplica("r1"), EchoReplica("r2")],
                     responses_request(previous_response_id=previous), times=20)
    assert {a["replica"] for a in answers} == {"r1"}


def test_a_response_whose_replica_is_gone_is_asked_of_any_replica_which_says_not_found():
    previous = response_ids.mint("d", "r7")  # no such replica any more: vLLM answers 404 there
    answers = served([EchoReplica("r0"), EchoReplica("r1")], responses_request(previous_response_id=previous), 40)
    assert {a["replica"] for a in answers} == {"r0", "r1"}


def test_a_response_whose_replica_is_gone_with_no_replica_up_is_404_at_once_not_a_cold_start():
    """Scaled to zero, a poll of an old id (or a turn after it) waited for a replica and reported
    demand, so the autoscaler started one (a GPU) only to answer 404."""
    import pytest

    from atomr_infer.errors import ResponseNotFound

    listed = [route(EchoReplica("r1"))]
    with pytest.raises(ResponseNotFound):  # r7 is not listed: gone
        response_ids.holding([], "d", response_ids.mint("d", "r7"), listed, {})
    with pytest.raises(ResponseNotFound):  # r1 died (excluded for good)
        response_ids.holding([], "d", response_ids.mint("d", "r1"), listed, {"atomr:d:r1": None})
    demand = []
    table = RoutingTable(1, {"d": DeploymentRoute("d", 64, "queue", (), cold_start_timeout_s=300.0)})

    async def source(version):
        return table if version != table.version else None

    async def main():
        router = Router(source, refresh_s=0.0, demand=lambda *args: demand.append(args))
        facts, request = responses_request(previous_response_id=response_ids.mint("d", "r7"))
        with pytest.raises(ResponseNotFound) as info:
            await asyncio.wait_for(answer(router.stream(facts, request)), 5)
        return info.value

    from atomr_infer.serve.answers import error_response

    refused = error_response(asyncio.run(main()))
    assert refused.status_code == 404 and json.loads(refused.body)["error"]["code"] == 404  # vLLM's own body
    assert "not found" in json.loads(refused.body)["error"]["message"] and demand == []


def test_a_response_whose_replica_is_briefly_unreachable_is_asked_of_it_again():
    """It went to another replica, which answered 404 "not found" (an agent lost its chain); one
    that died is asked of any replica, as one gone from the table."""
    previous = response_ids.mint("d", "r1")
    listed = [route(EchoReplica(n)) for n in ("r0", "r1")]
    usable = [listed[0]]  # r1 is listed but excluded
    assert response_ids.holding(usable, "d", previous, listed, {"atomr:d:r1": 7}) == [listed[1]]  # for now
    assert response_ids.holding(usable, "d", previous, listed, {"atomr:d:r1": None}) == usable  # dead
    assert response_ids.holding(usable, "d", response_ids.mint("d", "r9"), listed, {}) == usable  # gone
    assert response_ids.holding([], "d", previous, listed, {}) == []  # not excluded, only not usable: not forced

    table = RoutingTable(1, {"d": DeploymentRoute("d", 64, "queue", tuple(listed))})

    async def source(version):
        return table if version != table.version else None

    async def main():  # through the router: no newer table comes (the manager saw nothing)
        router = Router(source, refresh_s=0.0, wait_for_replica_s=5.0)
        await router.refresh()
        router.exclude("atomr:d:r1", permanent=False)
        asked = answer(router.stream(*responses_request(previous_response_id=previous)))
        return json.loads((await asyncio.wait_for(asked, 5))[1])

    assert asyncio.run(main())["replica"] == "r1"


def test_a_callers_own_request_id_is_kept():
    answers = served([EchoReplica("r0")], responses_request(request_id="resp_mine"))
    assert answers[0]["request_id"] == "resp_mine"


def test_only_ids_atomr_made_name_a_home():
    assert response_ids.home(response_ids.mint("smollm2", "r12")) == ("smollm2", "r12")
    for other in ("resp_0123456789abcdef", "resp_a.b", "resp_..x", "chatcmpl-1.r0.x", ""):
        assert response_ids.home(other) is None, other


def test_the_id_goes_first_into_the_body_and_the_rest_is_unchanged():
    request = HttpRequest("POST", "/v1/responses", JSON, b' {"model": "d", "input": [{"role": "user"}]}')
    body = json.loads(response_ids.with_request_id(request, "resp_d.r0.ab").body)
    assert body == {"request_id": "resp_d.r0.ab", "model": "d", "input": [{"role": "user"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_store_keeps_at_most_its_count_oldest_writes_first():
    store = StoreIndex(3, 3600.0).store()
    for i in range(5):
        store[f"k{i}"] = i
    assert sorted(store) == ["k2", "k3", "k4"] and "k0" not in store and store.get("k1") is None
    store["k2"] = "again"  # a write makes it the newest
    store["k5"] = 5
    assert sorted(store) == ["k2", "k4", "k5"]


def test_the_store_forgets_what_is_older_than_its_age_and_keeps_what_runs():
    clock, running = Clock(), {"bg"}
    store = StoreIndex(10, 60.0, keep=lambda key: key in running, clock=clock).store()
    store["old"], store["bg"] = 1, 2
    clock.now = 30.0
    store["new"] = 3
    clock.now = 61.0
    assert "old" not in store and store.get("new") == 3 and store["bg"] == 2  # bg still runs
    running.clear()
    assert "bg" not in store and store.pop("new") == 3 and len(store) == 0


def test_a_response_and_its_input_messages_are_kept_and_dropped_together():
    """vLLM writes the messages when a response starts and the response when it ends: bounded
    apart, a response outlived its messages, and its next turn lost the user's earlier turns."""
    clock = Clock()
    index = StoreIndex(2, 60.0, clock=clock)
    responses, messages = index.store(), index.store()
    messages["a"] = ["turn 1"]
    clock.now = 50.0
    responses["a"] = "answer"  # a 50 s generation
    clock.now = 70.0  # the messages were written 70 s ago, the response 20 s ago
    assert responses.get("a") == "answer" and messages.get("a") == ["turn 1"]
    messages["b"], messages["c"] = ["b"], ["c"]  # two more started: one id too many
    assert "a" not in responses and "a" not in messages  # the oldest id, from both
    messages.pop("b")
    responses["d"] = "d"  # b is held by no store: it takes no place
    assert sorted(messages) == ["c"] and sorted(responses) == ["d"]


def test_a_response_still_being_answered_is_not_pushed_out_by_newer_ones_only_by_its_age():
    """Its input messages are stored as it starts, the response as it ends: max_responses newer
    ones meanwhile dropped the messages, and its next turn lost the user's earlier input (under
    Harmony, vLLM's msg_store[id] raised KeyError: a 500). An aborted one still goes with its age."""
    from types import SimpleNamespace

    from atomr_infer.engine.vllm.response_store import configure_response_store
    from atomr_infer.spec.serving import ResponseStore

    serving = SimpleNamespace(background_tasks={})
    configure_response_store(SimpleNamespace(openai_serving_responses=serving),
                             ResponseStore(enabled=True, max_responses=4, max_age_s=60))
    clock = Clock()
    serving.msg_store._index._clock = clock
    serving.msg_store["a"] = ["my name is Ann"]  # a starts
    for i in range(4):  # four short ones start and end meanwhile
        serving.msg_store[f"k{i}"], serving.response_store[f"k{i}"] = [f"q{i}"], f"answer {i}"
    serving.response_store["a"] = "a's answer"  # a ends
    assert serving.msg_store["a"] == ["my name is Ann"] and serving.response_store["a"] == "a's answer"
    assert "k0" not in serving.response_store and sorted(serving.response_store) == ["a", "k1", "k2", "k3"]
    serving.msg_store["aborted"] = ["never answered"]
    clock.now = 61.0
    assert "aborted" not in serving.msg_store and len(serving.msg_store) == 0


def test_requests_their_clients_left_do_not_push_out_the_finished_responses():
    """vLLM writes no response for a request whose client left (or that failed): it looks answering
    until its age. Spared without a bound, five of them in a store of three pushed out every finished
    response as soon as it was written. Now those spared take at most half the store."""
    from types import SimpleNamespace

    from atomr_infer.engine.vllm.response_store import configure_response_store
    from atomr_infer.spec.serving import ResponseStore

    serving = SimpleNamespace(background_tasks={})
    configure_response_store(SimpleNamespace(openai_serving_responses=serving),
                             ResponseStore(enabled=True, max_responses=4, max_age_s=3600))
    for i in range(5):  # "stop generating", five times
        serving.msg_store[f"left{i}"] = ["a long input"]
    serving.msg_store["ok"], serving.response_store["ok"] = ["hi"], "hello"
    assert serving.response_store.get("ok") == "hello" and serving.msg_store.get("ok") == ["hi"]
    assert sorted(serving.msg_store) == ["left0", "left1", "left4", "ok"]  # two spared (until their age)


def test_a_response_whose_replica_has_not_loaded_the_adapter_yet_waits_for_it():
    """Found by a review: a request with an adapter naming a stored response whose replica was
    listed but had not loaded the adapter yet went to another replica, whose vLLM answered 404
    "not found" for a response that exists. It now waits for its replica, as a request for an
    adapter being loaded does; a replica gone still leaves it to any other."""
    r0, r1 = route(EchoReplica("r0")), route(EchoReplica("r1"))
    previous = response_ids.mint("d", "r1")
    assert response_ids.holding([r0], "d", previous, [r0, r1], {}) == []
    assert response_ids.holding([r0, r1], "d", previous, [r0, r1], {}) == [r1]
    assert response_ids.holding([r0], "d", previous, [r0], {}) == [r0]  # r1 gone: vLLM's own 404 there
    assert response_ids.holding([r0], "d", previous, [r0, r1], {r1.actor_name: None}) == [r0]  # r1 died
