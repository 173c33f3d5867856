"""Streams that move when their replica dies, without Ray: the replicas are fakes of the actor's
channel methods over the replica's real ``ChannelHub``; the first dies after sending part of a
stream and the token ids of that part, the second continues after them. The real path (vLLM
continuing at the token level, a replica killed under load) is tests/e2e/test_migration.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
from ray.exceptions import ActorDiedError, ObjectLostError

from atomr_infer.errors import EngineError
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.wire import HttpHead, HttpRequest, RoutingFacts

from .fakes import JSON, FakeReplica, route

SSE = (("content-type", "text/event-stream"),)
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'


def event(content: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


class Dying(FakeReplica):
    """Streams a role chunk and one token ("one", id 7), then its actor dies (reading its channel
    raises ``death``)."""

    def __init__(self, name: str, death: Exception | None = None) -> None:
        super().__init__(name)
        self.death = death or ActorDiedError()
        self.dead = asyncio.Event()
        self.heads: list[dict[str, str]] = []

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.heads.append(dict(request.headers))
        put(HttpHead(200, SSE))
        put(ROLE)
        put(event("one"))
        if tokens is not None:
            tokens([7])
        await asyncio.sleep(0.05)  # the batch goes out
        self.dead.set()
        await asyncio.Event().wait()

    async def _channel(self, channel_id):
        stream = self.hub.stream(channel_id).__aiter__()
        while True:
            following = asyncio.ensure_future(stream.__anext__())
            died = asyncio.ensure_future(self.dead.wait())
            done, _ = await asyncio.wait({following, died}, return_when=asyncio.FIRST_COMPLETED)
            if following in done:
                died.cancel()
                yield following.result()
                continue
            following.cancel()
            raise self.death


class Continuing(FakeReplica):
    """Continues a stream after ``resume``: a role chunk again, then " two" and the end."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.resumed: list[list[int] | None] = []
        self.heads: list[dict[str, str]] = []

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.resumed.append(resume)
        self.heads.append(dict(request.headers))
        put(HttpHead(200, SSE))
        put(ROLE + event(" two", "length") + b"data: [DONE]\n\n")


def chat(**fields) -> tuple[RoutingFacts, HttpRequest]:
    data = {"model": "d", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    return RoutingFacts.of("/v1/chat/completions", data), HttpRequest(
        "POST", "/v1/chat/completions", JSON, json.dumps(data).encode()
    )


def serve(facts, request, tries: int = 2, parses_output: bool = False, death: Exception | None = None,
          models: tuple[str, ...] = ("m", "m")):
    """Stream ``request`` where the table names the dying replica, then (once it died) the others;
    ``models``: the model each serves, the dying one's first (more than two: more replicas after)."""
    dying = Dying("r0", death)
    continuing, *others = [Continuing(f"r{i}") for i in range(1, len(models))]
    served = dict(zip([dying, continuing, *others], models, strict=True))

    def table(version, *replicas):
        routes = tuple(dataclasses.replace(route(r), model=served[r]) for r in replicas)
        dep = DeploymentRoute("d", 8, "queue", routes, migration_tries=tries, parses_output=parses_output)
        return RoutingTable(version, {"d": dep})

    before, after = table(1, dying), table(2, continuing, *others)

    async def source(version):
        current = after if dying.dead.is_set() else before
        return current if version != current.version else None

    got, failure, router = streamed(source, facts, request)
    return got, failure, router, dying, continuing


def streamed(source, facts, request):
    """(what a router streamed of ``request`` from ``source``'s tables, its EngineError or None, the router)."""

    async def main():
        router = Router(source, refresh_s=0.0, wait_for_replica_s=0.5)
        got: list = []
        try:
            async for item in router.stream(facts, request):
                got.append(item)
        except EngineError as exc:
            return got, exc, router
        return got, None, router

    return asyncio.run(main())


def test_a_chat_stream_goes_on_after_the_tokens_it_had_with_nothing_repeated_or_missing():
    got, failure, router, dying, continuing = serve(*chat())
    assert failure is None
    assert [i for i in got if isinstance(i, HttpHead)] == [HttpHead(200, SSE)]  # one head
    body = b"".join(i for i in got if not isinstance(i, HttpHead))
    assert body == ROLE + event("one") + event(" two", "length") + b"data: [DONE]\n\n"
    assert continuing.resumed == [[7]]  # after the first part's token ids
    request_id = dying.heads[0]["x-request-id"]  # named once: both parts' chunk ids are built from it
    assert continuing.heads[0]["x-request-id"] == request_id
    assert router.migrations == {("d", "dead"): 1}


def test_a_stream_whose_next_batch_was_lost_with_its_node_goes_on_too():
    # The replica's batch lived in the object store of a node that died: reading it raises Ray's
    # ObjectLostError, not an actor error. It used to escape the router (a 500, nothing moved).
    lost = ObjectLostError("ab" * 14, "owner", "call site")
    got, failure, router, _, continuing = serve(*chat(), death=lost)
    assert failure is None and continuing.resumed == [[7]]
    body = b"".join(i for i in got if not isinstance(i, HttpHead))
    assert body == ROLE + event("one") + event(" two", "length") + b"data: [DONE]\n\n"
    assert router.migrations == {("d", "unreachable"): 1}


def test_a_stream_continues_only_on_the_model_it_began_on():
    # Mid-roll to another model: the replica left that serves the old one takes it, not the new.
    got, failure, router, _, continuing = serve(*chat(), models=("old", "new", "old"))
    assert failure is None and continuing.resumed == []  # (r1, on the new model, was not picked)
    assert router.migrations == {("d", "dead"): 1}  # r2 took it
    assert b"".join(i for i in got if not isinstance(i, HttpHead)).endswith(b"data: [DONE]\n\n")
    # None left on the old model (the roll replaced them all): it ends as an unmoved stream does,
    # saying why, and the new model never continues the old one's tokens.
    got, failure, router, _, continuing = serve(*chat(), models=("old", "new"))
    assert isinstance(failure, EngineError) and "no replica of d serves old any more" in str(failure)
    assert continuing.resumed == []


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}}, {"logprobs": True}, {"n": 2},
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
])
def test_a_stream_whose_continuation_would_differ_fails_as_before(fields):
    got, failure, router, _, continuing = serve(*chat(**fields))
    assert isinstance(failure, EngineError) and "died mid-request" in str(failure)
    assert continuing.resumed == [] and not router.migrations


def test_a_deployment_that_parses_its_output_or_turns_migration_off_fails_as_before():
    for tries, parses in ((2, True), (0, False)):
        _, failure, router, _, continuing = serve(*chat(), tries=tries, parses_output=parses)
        assert isinstance(failure, EngineError) and continuing.resumed == [], (tries, parses)


def test_which_requests_may_move():
    def facts(path, **fields):
        return RoutingFacts.of(path, {"model": "d", "stream": True, **fields}).resumable

    assert facts("/v1/chat/completions") == facts("/v1/completions") == "anywhere"
    assert facts("/v1/chat/completions", response_format={"type": "text"}) == "anywhere"
    assert facts("/v1/chat/completions", response_format={"type": "json_schema"}) == "unstarted"
    assert facts("/v1/chat/completions", tools=[{}], tool_choice="none") == "anywhere"
    assert facts("/v1/completions", echo=True) == facts("/v1/completions", logprobs=2) == "unstarted"
    # 0 asks for the chosen token's logprob (0 == False in Python: it moved, and the continuation
    # failed in vLLM's logprobs of the resumed tokens)
    assert facts("/v1/completions", logprobs=0) == facts("/v1/completions", prompt_logprobs=0) == "unstarted"
    assert facts("/v1/chat/completions", logprobs=False) == "anywhere"
    # ... but where vLLM reads 0 as none (a flag, or top_logprobs' default), it moves as ever
    assert facts("/v1/chat/completions", top_logprobs=0) == facts("/v1/chat/completions", logprobs=0) == "anywhere"
    assert facts("/v1/completions", echo=0) == "anywhere"
    assert facts("/v1/chat/completions", logprobs=1) == facts("/v1/chat/completions", top_logprobs=2) == "unstarted"
    # beam search: an engine request per beam step; prompt embeddings: no token ids to extend
    assert facts("/v1/chat/completions", use_beam_search=True) == facts("/v1/completions", prompt_embeds="e") == (
        "unstarted")
    # stop strings: the text that may start one is held back, so the ids run ahead of the text sent
    assert facts("/v1/chat/completions", stop=["\n\nUser:"]) == facts("/v1/completions", stop="x") == "unstarted"
    assert facts("/v1/chat/completions", stop=[], stop_token_ids=[2]) == "anywhere"  # ids are whole tokens
    # several prompts: a choice each, their token ids in one stream (and one's end is not the answer's)
    assert facts("/v1/completions", prompt=["a", "b"]) == facts("/v1/completions", prompt=[[1], [2]]) == ""
    assert facts("/v1/completions", prompt=[1, 2, 3]) == facts("/v1/completions", prompt=["a"]) == "anywhere"
    assert facts("/v1/chat/completions", n=3) == facts("/v1/responses") == facts("/v1/messages") == ""
    assert RoutingFacts.of("/v1/chat/completions", {"model": "d"}).resumable == ""  # not a stream: re-run


def stream_over(tables, facts_request):
    """Stream through a router whose source gives ``tables`` in turn: the next once the one replica
    of the one before has failed."""
    facts, request = facts_request

    def failed(table: RoutingTable) -> bool:
        (replica,) = [r.actor for r in table.deployments["d"].replicas]
        return replica.dead.is_set() if isinstance(replica, Dying) else bool(replica.error and replica.calls)

    async def source(version):
        current = next((t for t in tables if not failed(t)), tables[-1])
        return current if version != current.version else None

    return streamed(source, facts, request)


def only(version: int, replica: FakeReplica, tries: int = 1) -> RoutingTable:
    return RoutingTable(version, {"d": DeploymentRoute("d", 8, "queue", (route(replica),), migration_tries=tries)})


def test_a_moved_stream_whose_next_replicas_died_with_the_node_goes_on_on_a_live_one():
    """A node died with the stream's replica and two more the table still listed: opening the
    continuation on each of those failed, and each failure counted as a move of its own, so
    ``max_tries`` ran out before the live replica was tried (the stream failed)."""
    dying, alive = Dying("r0"), Continuing("r3")
    gone1, gone2 = FakeReplica("r1", ActorDiedError()), FakeReplica("r2", ActorDiedError())
    tables = [only(1, dying), only(2, gone1), only(3, gone2), only(4, alive)]
    got, failure, router = stream_over(tables, chat())
    assert failure is None and gone1.calls and gone2.calls and alive.resumed == [[7]]
    assert b"".join(i for i in got if not isinstance(i, HttpHead)) == (
        ROLE + event("one") + event(" two", "length") + b"data: [DONE]\n\n")
    assert router.migrations == {("d", "dead"): 1}  # one move, tried on three replicas


class DiesAfter(Dying):
    """Sends ``sent`` whole, then dies before the router hears the stream ended."""

    def __init__(self, name: str, sent: bytes) -> None:
        super().__init__(name)
        self.sent = sent

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        put(HttpHead(200, SSE))
        put(self.sent)
        if tokens is not None:
            tokens([7, 8])
        await asyncio.sleep(0.05)
        self.dead.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("tail", [b"data: [DONE]\n\n", b""])
def test_a_stream_that_had_its_whole_answer_is_not_continued(tail):
    """The replica sent the choice's finish_reason (and maybe ``[DONE]``), then died before its end
    reached the router: the stream was continued, and a token past max_tokens came after ``[DONE]``."""
    sent = ROLE + event("one") + event(" two", "length") + tail
    dying, after = DiesAfter("r0", sent), Continuing("r1")
    got, failure, router = stream_over([only(1, dying, 2), only(2, after, 2)], chat(max_tokens=2))
    assert failure is None and after.resumed == [] and not router.migrations
    assert b"".join(i for i in got if not isinstance(i, HttpHead)) == sent + (b"" if tail else b"data: [DONE]\n\n")


class Refusing(FakeReplica):
    """Answers the continuation with an error (vLLM's serving layer refused it)."""

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        put(HttpHead(400, JSON))
        put(b'{"error":{"message":"This model\'s maximum context length is 8 tokens","code":400}}')


def test_a_continuation_that_fails_ends_the_stream_with_its_error_not_as_text():
    dying, refusing = Dying("r0"), Refusing("r1")
    got, failure, _ = stream_over([only(1, dying, 2), only(2, refusing, 2)], chat())
    assert isinstance(failure, EngineError) and "HTTP 400" in str(failure) and "maximum context" in str(failure)
    assert b"".join(i for i in got if not isinstance(i, HttpHead)) == ROLE + event("one")  # no JSON in the stream


class KeepingAlive(Continuing):
    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.resumed.append(resume)
        put(HttpHead(200, SSE))
        put(b": keep-alive\n\n")
        put(ROLE + event(" two", "length") + b"data: [DONE]\n\n")


def test_a_keep_alive_before_the_continuations_role_chunk_does_not_let_it_through():
    got, failure, _ = stream_over([only(1, Dying("r0"), 2), only(2, KeepingAlive("r1"), 2)], chat())
    assert failure is None
    body = b"".join(i for i in got if not isinstance(i, HttpHead))
    assert body == ROLE + event("one") + b": keep-alive\n\n" + event(" two", "length") + b"data: [DONE]\n\n"


def test_a_stream_whose_one_replica_died_waits_for_its_replacement():
    """One replica (or none other ready): the stream failed at once, saying a roll had changed
    the model; it now waits for the replica the manager starts instead, as an unstarted request does."""
    dying, replacement = Dying("r0"), Continuing("r1")

    def table(version: int, *replicas: FakeReplica) -> RoutingTable:
        routes = tuple(dataclasses.replace(route(r), model="m") for r in replicas)
        return RoutingTable(version, {"d": DeploymentRoute("d", 8, "queue", routes, migration_tries=1)})

    died: list[float] = []

    async def source(version):
        if not dying.dead.is_set():
            current = table(1, dying)
        else:
            died[:] = died or [time.monotonic()]
            current = table(2) if time.monotonic() - died[0] < 0.2 else table(3, replacement)
        return current if version != current.version else None

    got, failure, router = streamed(source, *chat())
    assert failure is None and replacement.resumed == [[7]] and router.migrations == {("d", "dead"): 1}
    assert b"".join(i for i in got if not isinstance(i, HttpHead)) == (
        ROLE + event("one") + event(" two", "length") + b"data: [DONE]\n\n")


class ContinuingAsBot(Continuing):
    """A deployment with ``response_role: bot``: every chat stream opens with that role."""

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.resumed.append(resume)
        put(HttpHead(200, SSE))
        put(ROLE.replace(b'"assistant"', b'"bot"') + event(" two", "length") + b"data: [DONE]\n\n")


def test_a_continuations_opening_chunk_is_dropped_whatever_role_it_names():
    got, failure, _ = stream_over([only(1, Dying("r0"), 2), only(2, ContinuingAsBot("r1"), 2)], chat())
    assert failure is None
    body = b"".join(i for i in got if not isinstance(i, HttpHead))
    assert body == ROLE + event("one") + event(" two", "length") + b"data: [DONE]\n\n"


def test_a_model_whose_every_chat_answer_vllm_parses_moves_its_streams_only_unstarted():
    """gpt-oss (Harmony): vLLM parses every chat answer whatever the spec's parsers, and a
    continuation's first chunk rebuilt its text from all the token ids: the earlier text again.
    The replica reports it among its engine facts; the routing table says so for the deployment."""
    from .test_manager import Harness, spec

    h = Harness()
    h.call("apply", spec())
    h.converge()
    assert not h.call("routing_table", -1).deployments["demo"].parses_output
    h.launcher.started[0].facts = {"parses_output": True}
    h.call("apply", spec(serving={"max_concurrent": 4}))  # any change publishes the table again
    assert h.call("routing_table", -1).deployments["demo"].parses_output


class BusyOnce(Continuing):
    """Its vLLM refuses the first continuation with a 503 (its queue full), then takes it."""

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        if not self.resumed:
            self.resumed.append(None)
            put(HttpHead(503, JSON))
            put(b'{"error":{"message":"The engine is currently busy and cannot accept new requests.","code":503}}')
            return
        await super()._serve(request, put, tokens, resume, prefilled)


def test_a_continuation_a_replica_refuses_with_503_is_tried_again():
    """The stream ended with "the continuation on another failed: HTTP 503", with tries left."""
    busy = BusyOnce("r1")
    got, failure, _ = stream_over([only(1, Dying("r0"), 2), only(2, busy, 2)], chat())
    assert failure is None and busy.resumed == [None, [7]]
    assert b"".join(i for i in got if not isinstance(i, HttpHead)) == (
        ROLE + event("one") + event(" two", "length") + b"data: [DONE]\n\n")
