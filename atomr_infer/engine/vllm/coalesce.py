"""Take every step an engine core in its own process has finished, as one.

With a GPU, vLLM's engine core runs in its own process and steps on its own; its outputs wait
in the ``SyncMPClient``'s ``outputs_queue`` until ``LLMEngine.step`` takes them, one step at a
time. Everything after the core (detokenizing, ``RequestOutput``s, vLLM's serving layer, our
channels) costs per output, so when hundreds of sequences step every few milliseconds that
work falls behind the core and stays behind: the replica delivers what its front half can
process, not what the GPU makes.

``CoalescingCoreClient`` wraps that client: ``get_output`` waits for one step as before, then
takes every further step already queued and returns them merged, one ``EngineCoreOutput`` per
request carrying all of its new tokens (the shape speculative decoding already gives vLLM's
output processor). So the cost per output is paid once per request per turn, however far the
core ran ahead: a front half that keeps up sees one step at a time, exactly as before, and one
that falls behind sends bigger deltas instead of falling further behind. No timer: nothing
waits for a step that is not there yet, so the first token leaves at once.

Only plain decode outputs merge (token ids, finish and stop reason). A step carrying anything
aligned to tokens or events (logprobs, pooling, KV transfer, stats events, ...), a step whose
scheduler stats count something of their own (prefix-cache lookups of newly scheduled requests,
evictions; speculative decoding's counts are added up instead), or a message that is not a
step (utility, wave) is returned on its own, in order.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import queue
from typing import Any

# Fields of an EngineCoreOutput that stop a step from merging when set: per-token or
# per-event data whose alignment a merge would have to rebuild.
_UNMERGEABLE = (
    "new_logprobs", "new_prompt_logprobs_tensors", "pooling_output", "events", "kv_transfer_params",
    "ec_transfer_params", "prefill_stats", "routed_experts", "mm_cache_miss_hashes", "new_sampling_mask",
    "prompt_token_id_logprobs",
)
# Steps merged in one turn at most: bounds one turn's work (and the step-loop watchdog's view of it).
MAX_STEPS_PER_TURN = 64


def is_plain(outputs: Any) -> bool:
    """Whether one step's ``EngineCoreOutputs`` holds only token deltas (and can merge)."""
    if isinstance(outputs, BaseException):
        return False
    if outputs.utility_output is not None or outputs.wave_complete is not None or outputs.start_wave is not None:
        return False
    if _counts_in(outputs.scheduler_stats):
        return False
    return _outputs_plain()(outputs.outputs)


@functools.cache
def _outputs_plain() -> Any:
    """``outputs -> bool``: whether no ``EngineCoreOutput`` in ``outputs`` sets a field of
    ``_UNMERGEABLE`` (those this vLLM has). Generated, as ``dataclasses`` generates ``__init__``:
    plain attribute reads in one loop cost a tenth of a ``getattr`` per field (0.05 against
    0.54 ms for a step of 1,024 requests), and every step the core makes is checked."""
    from vllm.v1.engine import EngineCoreOutput

    fields = [name for name in _UNMERGEABLE if name in EngineCoreOutput.__struct_fields__]
    if not fields:
        return lambda outputs: True
    test = " or ".join(f"o.{name} is not None" for name in fields)
    source = "\n".join([
        "def plain(outputs):",
        "    for o in outputs:",
        f"        if {test}:",
        "            return False",
        "    return True",
    ])
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # noqa: S102 - the names are ours, checked against vLLM's fields
    return namespace["plain"]


# SchedulerStats fields that, when set, are this step's own counts (vLLM's metrics add them up);
# speculative decoding's are summed by the merge instead (every step of it has them).
_STEP_COUNTS = (
    "kv_cache_eviction_events", "kv_connector_stats", "ec_connector_stats",
    "cudagraph_stats", "perf_stats", "iteration_details",
)


def _counts_in(stats: Any) -> bool:
    """Whether a step's ``SchedulerStats`` (present when vLLM logs stats) holds counts of its own:
    a merged step keeps only the last step's stats, right for the gauges (running, waiting, KV
    use) and a loss for counts. A decode step counts nothing (no prefix-cache lookups, no
    evictions) unless a KV connector is on; speculative decoding's counts are summed."""
    if stats is None:
        return False
    for cache in (getattr(stats, "prefix_cache_stats", None), getattr(stats, "connector_prefix_cache_stats", None)):
        if cache is not None and (cache.reset or cache.requests or cache.queries
                                  or getattr(cache, "preempted_requests", 0)):
            return True
    return any(getattr(stats, name, None) for name in _STEP_COUNTS)


def merge_steps(steps: list[Any]) -> Any:
    """One ``EngineCoreOutputs`` for consecutive plain steps: per request, its new tokens in order."""
    import msgspec

    first, last = steps[0], steps[-1]
    per_request: dict[str, list[Any]] = {}  # request id -> its outputs, in step order
    finished: set[str] = set()
    for step in steps:
        finished |= step.finished_requests or set()
        for out in step.outputs:
            per_request.setdefault(out.request_id, []).append(out)
    return msgspec.structs.replace(
        last,
        engine_index=first.engine_index,
        outputs=[outs[0] if len(outs) == 1 else _merge_request(outs) for outs in per_request.values()],
        scheduler_stats=_merge_stats([step.scheduler_stats for step in steps if step.scheduler_stats is not None]),
        finished_requests=finished or None,
    )


def _merge_stats(stats: list[Any]) -> Any:
    """The last step's ``SchedulerStats`` (its gauges are the current ones), with speculative
    decoding's counts of every step added up."""
    if not stats:
        return None
    spec = [s.spec_decoding_stats for s in stats if getattr(s, "spec_decoding_stats", None) is not None]
    total = functools.reduce(_add_spec, spec) if spec else None
    if total is getattr(stats[-1], "spec_decoding_stats", None):  # none, or only the last step's
        return stats[-1]
    return dataclasses.replace(stats[-1], spec_decoding_stats=total)


def _add_spec(a: Any, b: Any) -> Any:
    """Two steps' ``SpecDecodingStats`` as one (a new object: the steps' own are left as they were)."""
    return dataclasses.replace(
        a,
        num_drafts=a.num_drafts + b.num_drafts,
        num_draft_tokens=a.num_draft_tokens + b.num_draft_tokens,
        num_accepted_tokens=a.num_accepted_tokens + b.num_accepted_tokens,
        num_accepted_tokens_per_pos=_add(a.num_accepted_tokens_per_pos, b.num_accepted_tokens_per_pos),
        num_draft_tokens_per_pos=_add(a.num_draft_tokens_per_pos, b.num_draft_tokens_per_pos),
    )


def _add(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


def _merge_request(outs: list[Any]) -> Any:
    """One request's outputs of consecutive steps as one: all the tokens, the last step's end."""
    import msgspec

    last = outs[-1]
    return msgspec.structs.replace(
        outs[0],
        new_token_ids=[token for out in outs for token in out.new_token_ids],
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_nans_in_logits=sum(out.num_nans_in_logits for out in outs),
        spec_decode_metrics=last.spec_decode_metrics,
    )


class CoalescingCoreClient:
    """An engine-core client (``SyncMPClient``, or anything with ``get_output`` and an
    ``outputs_queue``) whose ``get_output`` returns every plain step queued, merged."""

    def __init__(self, inner: Any, max_steps: int = MAX_STEPS_PER_TURN) -> None:
        self._inner = inner
        self._max_steps = max_steps
        self._held: collections.deque[Any] = collections.deque()  # taken from the queue, not yet returned
        self.merged_steps = 0  # steps that rode along with an earlier one (for benchmarks, tests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _next(self) -> Any:
        if not self._held:
            return self._inner.get_output()
        item = self._held.popleft()
        if getattr(item, "wave_complete", None) is not None and hasattr(self._inner, "engines_running"):
            self._inner.engines_running = False  # as the inner client's get_output does
        if isinstance(item, BaseException):
            # What the inner client's get_output would have raised for it.
            fmt = getattr(self._inner, "_format_exception", None)
            raise (fmt(item) if fmt is not None else item) from None
        return item

    def get_output(self) -> Any:
        first = self._next()
        if not is_plain(first) or self._held:
            return first
        steps = [first]
        pending: queue.Queue[Any] = self._inner.outputs_queue
        while len(steps) < self._max_steps:
            try:
                item = pending.get_nowait()
            except queue.Empty:
                break
            if not is_plain(item):
                self._held.append(item)  # returned (or raised) on the next call, in order
                break
            steps.append(item)
        if len(steps) == 1:
            return first
        self.merged_steps += len(steps) - 1
        return merge_steps(steps)


def coalesce_core_outputs(engine: Any) -> bool:
    """Wrap ``engine.engine_core`` in a ``CoalescingCoreClient`` where the core runs on its own
    (its client queues outputs); an in-process core steps when asked, so there is nothing to merge."""
    if os.environ.get("ATOMR_COALESCE_STEPS", "1") == "0":  # to measure without it
        return False
    core = getattr(engine, "engine_core", None)
    if core is None or isinstance(core, CoalescingCoreClient) or not isinstance(
        getattr(core, "outputs_queue", None), queue.Queue
    ):
        return False
    engine.engine_core = CoalescingCoreClient(core)
    return True
