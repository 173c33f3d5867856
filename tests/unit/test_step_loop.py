"""The step loop with a scripted engine: one thread, one step per turn, no spinning."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from atomr_infer.engine.vllm.step_loop import StepLoop
from tests.waiting import wait_until


@dataclass
class Out:
    request_id: str
    n: int


@dataclass
class ScriptedEngine:
    """Each request produces `tokens` outputs, one per step, for every running request."""

    tokens: int = 3
    fail_on_step: int | None = None
    running: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    aborted: list[str] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)

    def add_request(self, request_id, prompt, params, **options):
        self.threads.add(threading.current_thread().name)
        if prompt == "bad":
            raise ValueError("prompt too long")
        self.running[request_id] = 0

    def step(self):
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("boom")
        outs = []
        for rid in list(self.running):
            self.running[rid] += 1
            outs.append(Out(rid, self.running[rid]))
            if self.running[rid] >= self.tokens:
                del self.running[rid]
        return outs

    def abort_request(self, ids):
        self.aborted.extend(ids)
        for rid in ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def get_tokenizer(self):
        return None


class Recorder:
    def __init__(self):
        self.batches: list[list[Out]] = []
        self.errors: list[BaseException] = []
        self.rejected: list[tuple[str, BaseException]] = []
        self.ready = threading.Event()
        self.done = threading.Event()

    def loop(self, engine) -> StepLoop:
        return StepLoop(
            engine_factory=lambda: engine,
            on_ready=lambda e: self.ready.set(),
            on_outputs=self.batches.append,
            on_error=lambda exc: (self.errors.append(exc), self.done.set()),
            on_rejected=lambda rid, exc: self.rejected.append((rid, exc)),
            name="test-step-loop",
        )


def test_one_step_serves_every_running_request():
    engine, rec = ScriptedEngine(tokens=3), Recorder()
    loop = rec.loop(engine)
    loop.start()
    assert rec.ready.wait(5)
    for rid in ("a", "b", "c"):
        loop.submit(rid, "p", None)
    wait_until(lambda: not engine.running and sum(len(b) for b in rec.batches) == 9)
    # Each request got 3 outputs, each from a distinct step, in order.
    for rid in ("a", "b", "c"):
        assert [o.n for b in rec.batches for o in b if o.request_id == rid] == [1, 2, 3]
    assert engine.threads == {"test-step-loop"}
    loop.stop()
    assert not loop.alive


def test_idle_loop_blocks_instead_of_spinning():
    engine, rec = ScriptedEngine(), Recorder()
    loop = rec.loop(engine)
    loop.start()
    assert rec.ready.wait(5)
    steps_before = engine.steps
    time.sleep(0.3)
    assert engine.steps == steps_before == 0
    loop.submit("x", "p", None)
    wait_until(lambda: engine.steps == 3)
    time.sleep(0.2)
    assert engine.steps == 3  # nothing to do again: no further steps
    loop.stop()


def test_abort_reaches_the_engine_within_one_step():
    engine, rec = ScriptedEngine(tokens=10_000), Recorder()
    loop = rec.loop(engine)
    loop.start()
    loop.submit("long", "p", None)
    wait_until(lambda: engine.steps >= 2)
    loop.abort(["long"])
    wait_until(lambda: "long" in engine.aborted)
    wait_until(lambda: not engine.has_unfinished_requests())
    loop.stop()


def test_a_rejected_request_fails_alone():
    engine, rec = ScriptedEngine(tokens=2), Recorder()
    loop = rec.loop(engine)
    loop.start()
    loop.submit("bad-one", "bad", None)
    loop.submit("good", "p", None)
    wait_until(lambda: sum(len(b) for b in rec.batches) == 2)
    assert [rid for rid, _ in rec.rejected] == ["bad-one"]
    assert isinstance(rec.rejected[0][1], ValueError)
    assert not rec.errors
    loop.stop()


def test_engine_failure_is_reported_once_and_ends_the_loop():
    engine, rec = ScriptedEngine(tokens=100, fail_on_step=2), Recorder()
    loop = rec.loop(engine)
    loop.start()
    loop.submit("a", "p", None)
    assert rec.done.wait(5)
    assert len(rec.errors) == 1 and str(rec.errors[0]) == "boom"
    wait_until(lambda: not loop.alive)
    assert isinstance(loop.error, RuntimeError)


def test_engine_build_failure_is_reported():
    rec = Recorder()

    def broken():
        raise OSError("no weights")

    loop = StepLoop(broken, lambda e: rec.ready.set(), rec.batches.append,
                    lambda exc: (rec.errors.append(exc), rec.done.set()), lambda *a: None)
    loop.start()
    assert rec.done.wait(5)
    assert not rec.ready.is_set()
    assert isinstance(rec.errors[0], OSError)


@pytest.mark.parametrize("n_requests", [1, 50])
def test_stuck_for_is_zero_outside_a_step(n_requests):
    engine, rec = ScriptedEngine(tokens=1), Recorder()
    loop = rec.loop(engine)
    loop.start()
    for i in range(n_requests):
        loop.submit(str(i), "p", None)
    wait_until(lambda: not engine.running and engine.steps > 0)
    wait_until(lambda: loop.stuck_for() == 0.0)  # idle: waiting for work is not being stuck
    time.sleep(0.1)
    assert loop.stuck_for() == 0.0
    loop.stop()


def test_stuck_for_grows_while_a_step_never_returns():
    release = threading.Event()

    class HangingEngine(ScriptedEngine):
        def step(self):
            if self.steps == 1:
                release.wait()
            return super().step()

    engine, rec = HangingEngine(tokens=5), Recorder()
    loop = rec.loop(engine)
    loop.start()
    loop.submit("a", "p", None)
    wait_until(lambda: loop.stuck_for() > 0.3)
    assert loop.alive and not rec.errors  # alive, answering nothing: only progress tells
    release.set()
    wait_until(lambda: not engine.running)
    wait_until(lambda: loop.stuck_for() == 0.0)
    loop.stop()


def test_an_engine_call_between_steps_counts_in_in_call_for_not_stuck_for():
    """Loading a LoRA adapter runs as an engine call: one that read a large adapter from a slow disk
    grew stuck_for as a hung step does, and the watchdog killed the replica as wedged."""
    release = threading.Event()
    engine, rec = ScriptedEngine(tokens=1), Recorder()
    loop = rec.loop(engine)
    loop.start()
    wait_until(rec.ready.is_set)
    future = loop.call(lambda engine: release.wait(5))
    wait_until(lambda: loop.in_call_for() > 0.3)
    assert loop.stuck_for() == 0.0 and not future.done()
    release.set()
    assert future.result(5) is True
    wait_until(lambda: loop.in_call_for() == 0.0 and loop.stuck_for() == 0.0)
    loop.stop()


def test_the_prefill_watch_tells_once_the_engine_says_a_watched_prompt_is_computed():
    """engine/vllm/prefill_watch.py, in the step thread's place: the engine knows the request by
    an id of its own (vLLM appends to ours when it adds it); a request not added yet, or gone,
    waits; one past prefill is handed over once; a forgotten one, or a later request with the
    same id, never is."""
    from types import SimpleNamespace

    from atomr_infer.engine.vllm.prefill_watch import PrefillWatch

    told, handed = [], []
    watch = PrefillWatch(lambda fn, done: handed.append((fn, done)))
    first, second, third, fourth = (SimpleNamespace(request_id=rid) for rid in "abcd")
    for request in (first, second, third, fourth):
        watch.add(request.request_id, request, lambda rid=request.request_id: told.append(rid))
    watch.after_step(SimpleNamespace())  # an engine without vLLM's output processor: nothing, no error
    states = {}
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states=states))
    watch.after_step(engine)  # none added yet
    assert handed == []
    for request in (first, second, third, fourth):
        request.request_id += "-x1"  # the engine added them
    states.update({"a-x1": SimpleNamespace(is_prefilling=False), "b-x1": SimpleNamespace(is_prefilling=True),
                   "c-x1": SimpleNamespace(is_prefilling=False)})  # d: already gone (finished)
    watch.forget("c")  # its stream ended meanwhile
    watch.after_step(engine)
    watch.after_step(engine)  # handed over once
    assert [[rid for rid, _ in done] for _, done in handed] == [["a"]]
    fn, done = handed[0]
    fn(done)  # in the event loop
    assert told == ["a"]
    states["b-x1"].is_prefilling = False
    watch.after_step(engine)
    watch.forget("b")  # b ended before the hand-over ran, and a new request took its id
    watch.add("b", SimpleNamespace(request_id="b"), lambda: told.append("b again"))
    handed[-1][0](handed[-1][1])
    assert told == ["a"]  # not the new b's callback
    states["d-x1"] = SimpleNamespace()  # a vLLM without is_prefilling: the watch turns itself off
    watch.after_step(engine)
    watch.add("e", SimpleNamespace(request_id="e"), lambda: told.append("e"))
    assert not watch._requests and told == ["a"]


def test_the_loop_reads_the_engine_after_every_step_in_its_own_thread():
    engine, rec = ScriptedEngine(tokens=3), Recorder()
    seen = []
    loop = StepLoop(engine_factory=lambda: engine, on_ready=lambda e: rec.ready.set(), on_outputs=rec.batches.append,
                    on_error=rec.errors.append, on_rejected=lambda rid, exc: None,
                    after_step=lambda e: seen.append((e, threading.current_thread().name)), name="test-after-step")
    loop.start()
    assert rec.ready.wait(5)
    loop.submit("a", "p", None)
    wait_until(lambda: len(seen) == 3)  # after each of its 3 steps (3 tokens), after their outputs
    loop.stop()
    assert len(rec.batches) == engine.steps == 3
    assert all(e is engine and name == "test-after-step" for e, name in seen)


def test_an_aborted_parallel_sampling_request_leaves_nothing_in_vllms_output_processor():
    """n > 1 aborted (its client left): vLLM's own LLMEngine.add_request/abort_request and output
    processor, over a core that takes everything. Aborted by its external id alone, the parent
    request stayed in the output processor for good, with the choices that had finished."""
    from types import SimpleNamespace

    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    aborted: list[str] = []
    engine = object.__new__(LLMEngine)  # its methods, with no executor or core process behind them
    engine.output_processor = OutputProcessor(None, log_stats=False)
    engine.engine_core = SimpleNamespace(add_request=lambda request: None, abort_requests=aborted.extend,
                                         dp_engines_running=lambda: False)
    engine.dp_group = None
    engine.input_processor = SimpleNamespace(apply_watermarking=lambda p, w: None, resolve_watermarking=lambda p: False,
                                             assign_request_id=InputProcessor.assign_request_id)
    engine.step = lambda: []
    engine.has_unfinished_requests = lambda: False
    rec = Recorder()
    loop = rec.loop(engine)
    loop.start()
    for i in range(20):
        params = SamplingParams(n=2, max_tokens=16, output_kind=RequestOutputKind.FINAL_ONLY)
        request = EngineCoreRequest(f"cmpl-{i}", [1, 2, 3], None, params, None, time.time(), None, None, None)
        loop.submit(request.request_id, request, params)
        loop.abort([request.request_id])
    wait_until(lambda: len(aborted) == 40)  # both choices of each, in the core
    processor = engine.output_processor
    assert (processor.parent_requests, processor.request_states, processor.external_req_ids) == ({}, {}, {})
    loop.stop()
    assert rec.rejected == [] and rec.errors == []


class RegistersThenRefuses(ScriptedEngine):
    """vLLM's ``LLMEngine.add_request``: the output processor holds the request before the core
    is handed it, and the core may refuse it; a core in this thread steps at once when nothing
    can run (a request waiting for its grammar)."""

    engine_core = type("InprocClient", (), {"engine_core": object()})()

    def add_request(self, request_id, prompt, params, **options):
        self.running[request_id] = 0
        if prompt == "bad":
            raise ValueError("the core refused it")

    def step(self):
        self.steps += 1
        return []


def test_a_request_the_core_refused_after_vllm_registered_it_is_aborted():
    """Left registered, it never finished: the loop stepped with no request open for the life of
    the replica, and the engine's unfinished count skewed its admission."""
    engine, rec = RegistersThenRefuses(), Recorder()
    loop = rec.loop(engine)
    loop.start()
    loop.submit("bad-one", "bad", None)
    wait_until(lambda: rec.rejected)
    wait_until(lambda: not engine.has_unfinished_requests())
    assert engine.aborted == ["bad-one"] and not rec.errors
    loop.stop()


def test_a_core_in_this_thread_with_nothing_to_run_is_not_spun_on():
    """vLLM's core process sleeps 1 ms when a step runs nothing; a core in the loop's thread
    returned at once, and the loop called step() some 400,000 times a second against the
    thread compiling the grammar it waited for. Bounded from above only: a slow machine steps less."""
    engine, rec = RegistersThenRefuses(), Recorder()
    loop = rec.loop(engine)
    loop.start()
    loop.submit("waits", "p", None)
    wait_until(lambda: engine.steps > 0)
    before = engine.steps
    time.sleep(0.5)
    assert engine.steps - before <= 600  # 1 ms apart at most: 500
    loop.stop()


def test_a_call_its_caller_stopped_waiting_for_leaves_the_loop_running():
    """An operator's call (an adapter load, a prefix-cache reset) whose caller timed out or left
    was cancelled while it ran: its result then could not be set, which ended the loop, and the
    replica was reported failed."""
    import asyncio

    engine, rec = ScriptedEngine(), Recorder()
    loop = rec.loop(engine)
    loop.start()
    assert rec.ready.wait(5)

    def slow(engine):
        time.sleep(0.3)
        return "loaded"

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(loop.call(slow)), 0.05)
        skipped = loop.call(slow)
        skipped.cancel()  # cancelled before the loop reached it: never run
        return await asyncio.wait_for(asyncio.wrap_future(loop.call(lambda engine: "answered")), 10)

    assert asyncio.run(main()) == "answered"
    assert loop.alive and not rec.errors
    loop.stop()
    assert not loop.alive


def test_calls_still_queued_when_the_loop_ends_are_answered():
    engine, rec = ScriptedEngine(tokens=100, fail_on_step=1), Recorder()
    loop = rec.loop(engine)
    late: list = []
    loop._on_error = lambda exc: (rec.errors.append(exc), late.append(loop.call(lambda e: "never")))
    loop.start()
    loop.submit("x", "p", None)
    wait_until(lambda: late)
    with pytest.raises(RuntimeError, match="step loop stopped"):
        late[0].result(timeout=5)
