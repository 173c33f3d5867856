"""The client libraries users build on, unchanged, against ``atomr serve``: the ``openai`` SDK's
Responses API (plain, streamed, stored and chained, in the background), the ``openai-agents``
SDK with its default model class (which speaks the Responses API), the ``anthropic`` SDK
(create, stream, count_tokens), and the two agent libraries that speak Chat Completions:
``langchain-openai`` (invoke, stream, structured output) and ``pydantic-ai`` (an agent's
text, streamed and typed output). The session's ``smollm2`` deployment stores responses and
parses tool calls (deployments/smollm2.yaml ``serving.openai``)."""

from __future__ import annotations

import asyncio
import time

import anthropic
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
ASK = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def oai(openai_server, smollm2) -> openai.OpenAI:
    return openai.OpenAI(base_url=openai_server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(openai_server, smollm2) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=openai_server.url, api_key="unused", max_retries=0, timeout=120)


def test_responses_create_and_stream(oai):
    reply = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    assert reply.status == "completed" and "Paris" in reply.output_text, reply
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    assert reply.id.startswith(f"resp_{MODEL}.r"), reply.id  # says which replica holds it
    with oai.responses.stream(model=MODEL, input=ASK, max_output_tokens=24, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == reply.output_text


def test_stored_responses_chain_and_are_retrieved(oai):
    first = oai.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", max_output_tokens=24,
                                 temperature=0, store=True)
    second = oai.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=24, temperature=0, store=True)
    assert second.previous_response_id == first.id and second.output_text
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.responses.retrieve(f"resp_{MODEL}.r0.0123456789abcdef")
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_gone.r0.0123' not found"):
        oai.responses.retrieve("resp_gone.r0.0123")  # its deployment is gone too: vLLM's answer all the same
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope", max_output_tokens=4)


def test_a_background_response_is_polled_to_completion(oai):
    started = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0, background=True,
                                   store=True)
    assert started.status in ("queued", "in_progress", "completed"), started.status
    deadline = time.monotonic() + 120
    reply = started
    while reply.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        reply = oai.responses.retrieve(started.id)
    assert reply.status == "completed" and "Paris" in reply.output_text, reply


def test_openai_agents_runs_an_agent_on_a_deployment(openai_server, smollm2):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # its traces go to OpenAI's servers: none here
    client = openai.AsyncOpenAI(base_url=openai_server.base_url, api_key="unused", max_retries=0)
    agent = Agent(
        name="geographer", instructions="Answer in one short sentence.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=32),  # a 135M model: greedy, or it guesses
    )
    result = Runner.run_sync(agent, "What is the capital of France?")
    assert "Paris" in result.final_output, result.final_output


class City(BaseModel):
    """The structured answer both agent libraries ask for."""

    name: str
    country: str


def test_langchain_openai_invokes_streams_and_gets_structured_output(openai_server, smollm2):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=openai_server.base_url, api_key="unused", temperature=0, max_tokens=24,
                     max_retries=0, timeout=120, stream_usage=True)
    reply = llm.invoke(ASK)
    assert "Paris" in reply.content, reply
    assert reply.usage_metadata["input_tokens"] > 0 and reply.usage_metadata["output_tokens"] > 0
    assert reply.response_metadata["model_name"] == MODEL
    chunks = list(llm.stream(ASK))
    assert "".join(c.content for c in chunks) == reply.content
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == \
        reply.usage_metadata["output_tokens"]  # stream_usage: vLLM's usage chunk reached it
    # Structured output as langchain asks for it by default (response_format json_schema): vLLM's
    # structured outputs keep even a 135M model's answer to the schema.
    roomy = llm.model_copy(update={"max_tokens": 64})  # room for the whole object
    city = roomy.with_structured_output(City).invoke("Which city is the capital of France?")
    assert isinstance(city, City) and city.name and city.country, city


def test_pydantic_ai_agent_answers_streams_and_returns_a_typed_output(openai_server, smollm2):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=openai_server.base_url, api_key="unused"))
    greedy = {"temperature": 0, "max_tokens": 32}
    agent = Agent(model, instructions="Answer in one short sentence.", model_settings=greedy)
    result = agent.run_sync("What is the capital of France?")
    assert "Paris" in result.output, result.output
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0

    async def streamed() -> tuple[str, str]:
        async with agent.run_stream("What is the capital of France?") as run:
            deltas = [delta async for delta in run.stream_text(delta=True)]
            return "".join(deltas), await run.get_output()

    text, output = asyncio.run(streamed())
    assert text == output == result.output
    # A typed output, asked as response_format json_schema (pydantic-ai's NativeOutput). Its
    # default, a tool the model must call, is left to tests/e2e/test_conformance.py: with the
    # hermes parser, vLLM's forced tool calls do not hold SmolLM2's arguments to the schema (the
    # same on `vllm serve`), and pydantic-ai rejects them.
    typed = Agent(model, output_type=NativeOutput(City), model_settings={"temperature": 0, "max_tokens": 64})
    city = typed.run_sync("Which city is the capital of France?").output
    assert isinstance(city, City) and city.name and city.country, city


def test_anthropic_messages_create_stream_and_count_tokens(claude):
    # This SDK has no `temperature` argument; Anthropic's API (and vLLM's) take it in the body.
    greedy = {"temperature": 0}
    message = claude.messages.create(model=MODEL, max_tokens=24, extra_body=greedy,
                                     messages=[{"role": "user", "content": ASK}])
    assert message.type == "message" and "Paris" in message.content[0].text, message
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body=greedy,
                                messages=[{"role": "user", "content": ASK}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == message.usage.input_tokens


def test_anthropic_errors_come_in_anthropics_shape(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-deployment", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    assert "no-such-deployment" in info.value.body["error"]["message"]


@pytest.fixture(scope="module")
def two_replicas(manager, ray_cluster, openai_server) -> str:
    """A deployment of two engine replicas that store responses."""
    from tests.conftest import smollm2_spec

    spec = smollm2_spec(name="stored", replicas=2)
    ray_cluster.get(manager.apply.remote(spec))
    status = ray_cluster.get(manager.wait_ready.remote(spec.name, 600))
    assert status is not None and status.replicas_ready == 2, status
    yield spec.name
    ray_cluster.get(manager.remove.remote(spec.name))


def test_stored_responses_live_on_their_replica_and_are_gone_with_it(oai, two_replicas, manager, ray_cluster):
    from atomr_infer.routing.response_ids import home
    from tests.conftest import smollm2_spec

    by_replica: dict[str, list[str]] = {}
    for i in range(40):  # power of two over two idle replicas is a coin flip a request: both, soon
        reply = oai.responses.create(model=two_replicas, input=f"Count to {i}.", max_output_tokens=8, store=True)
        by_replica.setdefault(home(reply.id).replica_id, []).append(reply.id)
        if i >= 7 and len(by_replica) == 2:
            break
    assert sorted(by_replica) == ["r0", "r1"], by_replica
    for response_id in [i for ids in by_replica.values() for i in ids]:  # each found on its replica
        assert oai.responses.retrieve(response_id).id == response_id
    chained = oai.responses.create(model=two_replicas, input="Go on.", previous_response_id=by_replica["r1"][0],
                                   max_output_tokens=8, store=True)
    assert home(chained.id).replica_id == "r1"  # made where its previous response lives

    ray_cluster.get(manager.apply.remote(smollm2_spec(name=two_replicas, replicas=1)))  # one of them goes
    deadline = time.monotonic() + 120
    while len(serving := [r for r in ray_cluster.get(manager.status.remote(two_replicas)).replicas
                          if r.state != "stopped"]) > 1:  # a stopped one stays listed a while
        assert time.monotonic() < deadline, serving
        time.sleep(0.5)
    kept = serving[0].replica_id
    gone = next(r for r in by_replica if r != kept)
    for response_id in by_replica[gone]:  # vLLM's own answer, from the replica that is left
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{response_id}' not found"):
            oai.responses.retrieve(response_id)
    assert oai.responses.retrieve(by_replica[kept][0]).id == by_replica[kept][0]


def test_a_background_response_is_cancelled_on_its_replica(oai, smollm2_replica, ray_cluster):
    started = oai.responses.create(model=MODEL, input="Write a long story about a cat.", max_output_tokens=1500,
                                   background=True, store=True, extra_body={"ignore_eos": True})
    cancelled = oai.responses.cancel(started.id)
    assert cancelled.status == "cancelled", cancelled.status
    assert oai.responses.retrieve(started.id).status == "cancelled"
    deadline = time.monotonic() + 10  # and the engine stopped generating it
    while ray_cluster.get(smollm2_replica.stats.remote()).engine_unfinished:
        assert time.monotonic() < deadline, "the cancelled response still runs in the engine"
        time.sleep(0.1)
