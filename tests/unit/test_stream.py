"""Per-request streams: bounded by merging, one item per step, errors after pending output.

The items are vLLM's own ``RequestOutput`` deltas, merged by vLLM's ``RequestOutput.add``."""

from __future__ import annotations

import asyncio

import pytest
from vllm.outputs import CompletionOutput, RequestOutput

from atomr_infer.engine.vllm.stream import RequestStream
from atomr_infer.errors import EngineError


def delta(text: str, token_ids: list[int], finish: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, token_ids, None, None, finish_reason=finish)
    return RequestOutput("r", None, [1], None, [completion], finished=finish is not None)


def put(stream: RequestStream, text: str, token_ids: list[int], finish: str | None = None) -> None:
    stream.put(delta(text, token_ids, finish))


def collect(stream: RequestStream):
    async def run():
        return [c async for c in stream]

    return run()


def test_lagging_consumer_gets_merged_deltas():
    async def main():
        s = RequestStream("r", prompt_tokens=4)
        put(s, "Hel", [1])
        put(s, "lo", [2])
        put(s, " there", [3], "stop")
        return await collect(s), s

    outs, s = asyncio.run(main())
    assert len(outs) == 1
    assert outs[0].outputs[0].text == "Hello there"
    assert list(outs[0].outputs[0].token_ids) == [1, 2, 3]
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].finished
    assert (s.prompt_tokens, s.completion_tokens) == (4, 3)


def test_a_lagging_consumer_of_cumulative_outputs_gets_the_latest_not_a_sum():
    """vLLM's SamplingParams default to CUMULATIVE (each output holds every token so far), which a
    few of its serving paths keep: merged as deltas, a lagging reader got [7, 7, 8] for [7, 8], and
    the token counts grew with the square of the length. vLLM's collector keeps the later one."""

    async def main():
        s = RequestStream("r", prompt_tokens=2, cumulative=True)
        put(s, "a", [7])
        put(s, "ab", [7, 8])
        first = await anext(aiter(s))
        put(s, "abc", [7, 8, 9], "length")
        return first, await collect(s), s

    first, rest, s = asyncio.run(main())
    assert list(first.outputs[0].token_ids) == [7, 8] and first.outputs[0].text == "ab"
    assert [list(o.outputs[0].token_ids) for o in rest] == [[7, 8, 9]]
    assert (s.completion_tokens, s.decode_tokens) == (3, 3)

    from types import SimpleNamespace

    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from atomr_infer.engine.stats import StatsCollector
    from atomr_infer.engine.vllm.open_streams import OpenStreams
    from atomr_infer.metrics import ReplicaMetrics

    log = SimpleNamespace(debug=lambda *a, **k: None, info=lambda *a, **k: None)
    streams = OpenStreams(SimpleNamespace(submit=lambda *a, **k: None), StatsCollector(),
                          ReplicaMetrics("d", "r0", enabled=False), log)
    kinds = {kind: streams.open(kind.name, 2, "p", SamplingParams(output_kind=kind))._cumulative
             for kind in RequestOutputKind}  # the stream merges as the request's params say
    assert kinds == {RequestOutputKind.CUMULATIVE: True, RequestOutputKind.DELTA: False,
                     RequestOutputKind.FINAL_ONLY: False}


def test_prompt_consumer_gets_each_step_separately():
    async def main():
        s = RequestStream("r", prompt_tokens=1)
        got = []

        async def consume():
            async for c in s:
                got.append(c.outputs[0].text)

        task = asyncio.create_task(consume())
        for piece, fin in (("a", None), ("b", None), ("c", "length")):
            put(s, piece, [0], fin)
            await asyncio.sleep(0)  # let the consumer run, as a real step would
            await asyncio.sleep(0)
        await task
        return got, s

    got, s = asyncio.run(main())
    assert got == ["a", "b", "c"]
    assert s.completion_tokens == 3 and s.finished


def test_error_is_raised_after_pending_output():
    async def main():
        s = RequestStream("r", prompt_tokens=1)
        put(s, "partial", [5])
        s.fail(EngineError("engine died"))
        got = []
        with pytest.raises(EngineError, match="engine died"):
            async for c in s:
                got.append(c.outputs[0].text)
        return got

    assert asyncio.run(main()) == ["partial"]


def test_nothing_is_accepted_after_the_end():
    async def main():
        s = RequestStream("r", prompt_tokens=1)
        put(s, "x", [1], "stop")
        put(s, "late", [2])
        s.fail(EngineError("late error"))
        return await collect(s)

    outs = asyncio.run(main())
    assert [c.outputs[0].text for c in outs] == ["x"]


def test_a_whole_answer_times_its_first_token_by_vllms_own_stats():
    """``stream: false`` (vLLM's FINAL_ONLY): one output, at the end, with every token. Its time
    to first token was recorded as its whole latency and its time per token as 0; the first token
    now comes as long before the end as vLLM's stats say the decode took, and without stats it is
    not recorded at all."""
    from vllm.v1.metrics.stats import RequestStateStats

    whole = delta("Paris is the capital", [1, 2, 3, 4, 5], "length")
    whole.metrics = RequestStateStats(first_token_ts=100.0, last_token_ts=100.8)
    s = RequestStream("r", prompt_tokens=4)
    s.put(whole)
    assert s.last_token_at is not None and s.first_token_at == pytest.approx(s.last_token_at - 0.8)
    bare = RequestStream("r", prompt_tokens=4)
    bare.put(delta("Paris is the capital", [1, 2, 3, 4, 5], "length"))  # no stats kept
    assert bare.first_token_at is None and bare.last_token_at is None and bare.completion_tokens == 5
    one = RequestStream("r", prompt_tokens=4)  # a streamed answer of one token: its one output is its first
    one.put(delta("Paris", [1], "stop"))
    assert one.first_token_at is not None and one.first_token_at == one.last_token_at


def test_time_per_output_token_is_per_sequence_when_a_request_has_n_choices(monkeypatch):
    """vLLM steps a request's n choices side by side: one output per choice per step, all under
    the request's id. Their tokens were summed before dividing the decode time, so time per
    output token (and `atomr status` TOK/S) was about n times too fast; it is now per sequence,
    as vLLM's own metric, while the token totals still count every choice."""
    from types import SimpleNamespace

    from atomr_infer.engine.stats import StatsCollector
    from atomr_infer.engine.vllm import stream as stream_module
    from atomr_infer.engine.vllm.open_streams import OpenStreams
    from atomr_infer.metrics import ReplicaMetrics

    clock = [100.0]
    monkeypatch.setattr(stream_module.time, "monotonic", lambda: clock[0])
    records: list[tuple[str, float]] = []
    metrics = ReplicaMetrics("d", "r0", enabled=False)
    metrics._m = {name: SimpleNamespace(record=lambda v, tags=None, name=name: records.append((name, v)))
                  for name in metrics._m}
    stats = StatsCollector()
    loop = SimpleNamespace(submit=lambda *a, **k: None, abort=lambda ids: None)
    log = SimpleNamespace(debug=lambda *a, **k: None, info=lambda *a, **k: None)
    streams = OpenStreams(loop, stats, metrics, log)
    s = streams.open("r", 4, "p", None)
    n, steps, step_s = 4, 10, 0.05
    for step in range(steps):
        clock[0] += step_s
        for child in range(n):
            last = step == steps - 1 and child == n - 1
            completion = CompletionOutput(child, "x", [step], None, None, finish_reason="length" if last else None)
            streams.dispatch([RequestOutput("r", None, [1], None, [completion], finished=last)])
    assert [v for name, v in records if name == "atomr_time_per_output_token_seconds"] == [pytest.approx(step_s)]
    assert [v for name, v in records if name == "atomr_generation_tokens_total"] == [n * steps]
    snap = stats.snapshot(phase="ready", in_flight=0, waiting=0, kv_cache_usage=None, uptime_s=1, steps=steps,
                          engine_unfinished=0)
    assert snap.time_per_output_token_s.p50 == pytest.approx(step_s) and snap.tokens_generated == n * steps
    assert (s.completion_tokens, s.decode_tokens) == (n * steps, steps)
