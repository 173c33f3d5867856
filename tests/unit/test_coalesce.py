"""Merging the steps an engine core in its own process has finished (engine/vllm/coalesce.py), on
vLLM's own output types. ``QueuedCore`` stands for vLLM's ``SyncMPClient`` (which needs a core
process): what the coalescing client uses of it is ``get_output`` and its ``outputs_queue``.
The same client over a real vLLM front half runs in test_coalesce_engine.py."""

from __future__ import annotations

import queue

import pytest
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

from atomr_infer.engine.vllm.coalesce import (
    _UNMERGEABLE,
    CoalescingCoreClient,
    coalesce_core_outputs,
    is_plain,
    merge_steps,
)


class QueuedCore:
    def __init__(self) -> None:
        self.outputs_queue: queue.Queue = queue.Queue()
        self.aborted: list[str] = []

    def get_output(self):
        item = self.outputs_queue.get(timeout=5)
        if isinstance(item, Exception):
            raise item
        return item

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted += ids


def step(*outs: EngineCoreOutput, **kw) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outs), **kw)


def test_consecutive_steps_merge_per_request_in_order():
    steps = [
        step(EngineCoreOutput("a", [1]), EngineCoreOutput("b", [10]), timestamp=1.0),
        step(EngineCoreOutput("a", [2]), EngineCoreOutput("b", [11], finish_reason=FinishReason.STOP, stop_reason=7),
             timestamp=2.0, finished_requests={"b"}),
        step(EngineCoreOutput("a", [3], finish_reason=FinishReason.LENGTH), EngineCoreOutput("c", [20]),
             timestamp=3.0, finished_requests={"a"}),
    ]
    merged = merge_steps(steps)
    by_id = {o.request_id: o for o in merged.outputs}
    assert [o.request_id for o in merged.outputs] == ["a", "b", "c"]
    assert by_id["a"].new_token_ids == [1, 2, 3] and by_id["a"].finish_reason == FinishReason.LENGTH
    assert by_id["b"].new_token_ids == [10, 11] and by_id["b"].finish_reason == FinishReason.STOP
    assert by_id["b"].stop_reason == 7
    assert by_id["c"].new_token_ids == [20] and by_id["c"].finish_reason is None
    assert merged.finished_requests == {"a", "b"} and merged.timestamp == 3.0
    assert steps[0].outputs[0].new_token_ids == [1]  # the steps themselves are left as they were


def test_a_step_with_per_token_data_is_not_plain():
    assert is_plain(step(EngineCoreOutput("a", [1])))
    assert not is_plain(step(EngineCoreOutput("a", [1], kv_transfer_params={"x": 1})))
    assert not is_plain(step(EngineCoreOutput("a", [1], events=[])))
    assert not is_plain(step(wave_complete=3))
    assert not is_plain(RuntimeError("core died"))


@pytest.mark.parametrize("field", _UNMERGEABLE)
def test_each_per_token_field_stops_a_merge_wherever_it_is_set(field):
    assert field in EngineCoreOutput.__struct_fields__  # a vLLM that renamed it would merge it
    plain = [EngineCoreOutput(f"r{i}", [1]) for i in range(5)]
    assert is_plain(step(*plain))
    for at in (0, 4):
        outs = list(plain)
        outs[at] = EngineCoreOutput(f"r{at}", [1], **{field: object()})
        assert not is_plain(step(*outs)), (field, at)


def test_get_output_takes_every_queued_step_and_keeps_the_rest_in_order():
    core = QueuedCore()
    client = CoalescingCoreClient(core)
    for i in range(3):
        core.outputs_queue.put(step(EngineCoreOutput("a", [i])))
    special = step(EngineCoreOutput("a", [3], kv_transfer_params={"k": "v"}))
    core.outputs_queue.put(special)
    core.outputs_queue.put(step(EngineCoreOutput("a", [4])))

    first = client.get_output()
    assert [o.new_token_ids for o in first.outputs] == [[0, 1, 2]]
    assert client.get_output() is special  # on its own, after the merged ones
    assert [o.new_token_ids for o in client.get_output().outputs] == [[4]]
    assert client.merged_steps == 2
    client.abort_requests(["a"])  # everything else reaches the client it wraps
    assert core.aborted == ["a"]


def test_an_error_queued_behind_steps_is_raised_after_them():
    core = QueuedCore()
    client = CoalescingCoreClient(core)
    core.outputs_queue.put(step(EngineCoreOutput("a", [1])))
    core.outputs_queue.put(RuntimeError("engine core died"))
    assert client.get_output().outputs[0].new_token_ids == [1]
    with pytest.raises(RuntimeError, match="engine core died"):
        client.get_output()


def test_one_turn_takes_at_most_max_steps():
    core = QueuedCore()
    client = CoalescingCoreClient(core, max_steps=4)
    for i in range(6):
        core.outputs_queue.put(step(EngineCoreOutput("a", [i])))
    assert client.get_output().outputs[0].new_token_ids == [0, 1, 2, 3]
    assert client.get_output().outputs[0].new_token_ids == [4, 5]


def test_only_a_core_that_queues_its_outputs_is_wrapped(monkeypatch):
    class Engine:
        pass

    inproc = Engine()
    inproc.engine_core = object()  # vLLM's InprocClient steps when asked: nothing queues
    assert not coalesce_core_outputs(inproc)
    queued = Engine()
    queued.engine_core = QueuedCore()
    assert coalesce_core_outputs(queued) and isinstance(queued.engine_core, CoalescingCoreClient)
    assert not coalesce_core_outputs(queued)  # not twice
    monkeypatch.setenv("ATOMR_COALESCE_STEPS", "0")
    off = Engine()
    off.engine_core = QueuedCore()
    assert not coalesce_core_outputs(off)


def test_steps_whose_stats_count_something_are_not_merged():
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    def stats(**kw) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=2, **kw)

    decode = [step(EngineCoreOutput("a", [i]), scheduler_stats=stats(kv_cache_usage=i / 10)) for i in range(3)]
    assert all(is_plain(s) for s in decode)  # gauges only: the last step's are the right ones
    assert merge_steps(decode).scheduler_stats.kv_cache_usage == 0.2
    lookups = stats(prefix_cache_stats=PrefixCacheStats(requests=1, queries=64, hits=32))
    assert not is_plain(step(EngineCoreOutput("a", [1]), scheduler_stats=lookups))

    core = QueuedCore()
    client = CoalescingCoreClient(core)
    for s in (decode[0], step(EngineCoreOutput("a", [9]), scheduler_stats=lookups), decode[1], decode[2]):
        core.outputs_queue.put(s)
    assert client.get_output() is decode[0]
    counted = client.get_output()  # on its own: its prefix-cache counts reach vLLM's metrics
    assert counted.scheduler_stats.prefix_cache_stats.queries == 64
    assert [o.new_token_ids for o in client.get_output().outputs] == [[1, 2]]


def test_speculative_decodings_counts_are_added_up_over_merged_steps():
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    def spec(*drafts: tuple[int, int]) -> SpecDecodingStats:
        stats = SpecDecodingStats.new(3)
        for drafted, accepted in drafts:
            stats.observe_draft(drafted, accepted)
        return stats

    steps = [
        step(EngineCoreOutput("a", [1, 2]), scheduler_stats=SchedulerStats(spec_decoding_stats=spec((3, 1)))),
        step(EngineCoreOutput("a", [3]), scheduler_stats=SchedulerStats(num_running_reqs=1)),
        step(EngineCoreOutput("a", [4, 5, 6]), scheduler_stats=SchedulerStats(
            num_running_reqs=2, spec_decoding_stats=spec((3, 2), (2, 2)))),
    ]
    assert all(is_plain(s) for s in steps)
    merged = merge_steps(steps)
    total = merged.scheduler_stats.spec_decoding_stats
    assert merged.outputs[0].new_token_ids == [1, 2, 3, 4, 5, 6]
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (3, 8, 5)
    assert total.num_accepted_tokens_per_pos == [3, 2, 0] and total.num_draft_tokens_per_pos == [3, 3, 2]
    assert merged.scheduler_stats.num_running_reqs == 2  # a gauge: the last step's
    assert steps[2].scheduler_stats.spec_decoding_stats.num_drafts == 2  # the steps are left as they were
