"""The typed wire's own behaviour: routing facts read once from a body, the one merging buffer,
the replica's lifecycle machine, and the manager's vLLM checks that load no vLLM (no Ray)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from atomr_infer.errors import EngineError, InvalidRequest, ReplicaUnavailable
from atomr_infer.merging import MergingBuffer, join_bytes
from atomr_infer.replica.lifecycle import Lifecycle
from atomr_infer.status import ReplicaState
from atomr_infer.wire import Batch, HttpHead, LastBytes, RequestKind, RoutingFacts


def test_routing_facts_come_from_the_parsed_body_once():
    messages = [{"role": "user", "content": "hi"}]
    facts = RoutingFacts.of("/v1/chat/completions", {"model": "m", "messages": messages, "stream": True})
    assert (facts.deployment, facts.kind, facts.stream, facts.usage_wanted) == ("m", RequestKind.CHAT, True, False)
    assert facts.prompt is messages  # the parsed value itself: nothing is parsed again for routing
    asked = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    assert RoutingFacts.of("/v1/completions", asked).usage_wanted
    # Routing reads a chat's messages when they are a list, else a prompt's text, as it always did.
    assert RoutingFacts.of("/v1/completions", {"model": "m", "messages": "x", "prompt": "p"}).prompt == "p"
    with pytest.raises(InvalidRequest) as info:
        RoutingFacts.of("/v1/completions", {"prompt": "p"})
    assert info.value.field == "model"


@pytest.mark.parametrize("stream, include_usage, streams, usage", [
    (1, None, True, False), ("true", None, True, False), ("yes", None, True, False),  # vLLM streams these
    (True, "false", True, False), (True, 0, True, False), (True, "on", True, True),
    (0, None, False, True), ("maybe", None, False, True),  # not a stream (vLLM refuses "maybe": 400)
])
def test_stream_and_include_usage_are_read_as_vllm_reads_them(stream, include_usage, streams, usage):
    """Read as ``is True``, ``"stream": 1`` streamed with no usage for a token budget to charge."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    facts = RoutingFacts.of("/v1/chat/completions", body)
    assert (facts.stream, facts.usage_wanted) == (streams, usage)
    if stream != "maybe":
        vllm_reads = ChatCompletionRequest.model_validate(body)
        assert vllm_reads.stream == streams
        assert bool(vllm_reads.stream_options and vllm_reads.stream_options.include_usage) == (usage and streams)


def test_a_merging_buffer_joins_what_the_reader_has_not_taken_and_ends_with_its_error():
    async def main():
        buffer: MergingBuffer = MergingBuffer(join_bytes)
        buffer.put(HttpHead(200, ()))
        buffer.put(b"a")
        buffer.put(b"b")  # not taken yet: joined with b"a"
        buffer.end(EngineError("gone"))
        buffer.put(b"late")  # after the end: dropped
        got = []
        with pytest.raises(EngineError):
            async for item in buffer:
                got.append(item)
        return got

    assert asyncio.run(main()) == [HttpHead(200, ()), b"ab"]


def test_a_routers_inbox_marks_the_last_bytes_of_a_stream_that_ended_with_them():
    """The ingress ends an HTTP response with ``LastBytes`` (serve/answers.py), so they mark only
    bytes after which nothing can come: the end came with them, without an error."""
    from atomr_infer.routing.channel import _Inbox

    async def read(inbox: _Inbox, feed=None) -> list:
        got = []
        try:
            async for item in inbox:
                got.append(item)
                if feed is not None:
                    feed, step = None, feed
                    step()
        except EngineError:
            got.append("error")
        return got

    async def main():
        ended_with = _Inbox()
        ended_with.put_all([HttpHead(200, ()), b"a", b"b"])  # one batch: the head, then b"ab"
        ended_with.end()
        later = _Inbox()
        later.put_all([HttpHead(200, ()), b"a"])
        failed = _Inbox()
        failed.put_all([HttpHead(200, ()), b"a"])
        failed.end(EngineError("gone"))
        head_only = _Inbox()
        head_only.put(HttpHead(204, ()))
        head_only.end()
        return await read(ended_with), await read(later, feed=later.end), await read(failed), await read(head_only)

    ended_with, later, failed, head_only = asyncio.run(main())
    assert ended_with == [HttpHead(200, ()), b"ab"] and type(ended_with[1]) is LastBytes
    assert later == [HttpHead(200, ()), b"a"] and not any(isinstance(x, LastBytes) for x in later)  # end came after
    assert failed == [HttpHead(200, ()), b"a", "error"] and not any(isinstance(x, LastBytes) for x in failed)
    assert head_only == [HttpHead(204, ())]  # a head is never marked


def test_the_replica_lifecycle_allows_only_its_transitions():
    life = Lifecycle("r")
    assert life.admission_error() is None and life.state is ReplicaState.STARTING
    assert life.to(ReplicaState.READY, "serving")
    assert life.to(ReplicaState.DRAINING)
    assert not life.to(ReplicaState.READY)  # a draining replica never serves again
    assert isinstance(life.admission_error(), ReplicaUnavailable)
    assert life.to(ReplicaState.UNHEALTHY, error=EngineError("boom"))
    # unhealthy: the router tries another replica (the manager replaces this one)
    assert not life.to(ReplicaState.READY) and isinstance(life.admission_error(), ReplicaUnavailable)
    assert "unhealthy: EngineError('boom')" in str(life.admission_error())
    assert life.to(ReplicaState.STOPPED) and not life.to(ReplicaState.UNHEALTHY)  # stopped is final
    report = life.report(in_flight=2, waiting=1)
    assert (report.state, report.in_flight, report.error) == (ReplicaState.STOPPED, 2, "EngineError: boom")


def test_a_batch_with_only_token_ids_has_news():
    assert not Batch(0) and Batch(0, token_ids={"r": [1]}) and Batch(0, ended={"r": None})
    assert Batch(0, prefilled=["r"])  # a batch that only says a request was prefilled leaves too


PROBE = """
import sys
from atomr_infer.control.manager import DeploymentManager
from atomr_infer.control.client import ControlPlane
from atomr_infer.client import Client
from atomr_infer.serve.app import OpenAIIngress
from atomr_infer.cli.main import main
from atomr_infer.errors import SpecError
from atomr_infer.spec import parse_deployment
spec = parse_deployment({"name": "d", "model": "m", "runtime_config": {"extra_engine_args": {"max_num_seq": 4}},
                         "serving": {"openai": {"tool_call_parser": "hermez"}}})
try:
    DeploymentManager._check_engine_args(spec)
except SpecError as exc:
    print("refused:", exc)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
print("loaded:", loaded[:5])
"""


def test_the_control_plane_refuses_bad_engine_settings_without_loading_vllm_or_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded: []" in out.stdout, out.stdout
    refused = next(line for line in out.stdout.splitlines() if line.startswith("refused:"))
    assert "extra_engine_args.max_num_seq" in refused and "max_num_seqs" in refused, refused
    assert "tool_call_parser" in refused and "'hermes'" in refused, refused
