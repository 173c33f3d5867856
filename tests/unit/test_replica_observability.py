"""A replica's logs and metrics, in-process with a scripted engine (no Ray, no vLLM).

The replica runs here exactly as in its actor, over the real vLLM backend (engine/vllm/backend.py):
its step-loop thread drives the engine and the test's event loop plays Ray's. Requests enter
where vLLM's serving layer submits them (the backend's ``submit``, the engine client's gate),
so vLLM's OpenAI app is not built (it needs a real engine: the integration tests run it). Log
lines go through the real structlog JSON pipeline; metrics go to recorders in place of
``ray.util.metrics`` (which needs a Ray worker; the integration test scrapes the real ones).
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import structlog

from atomr_infer import log as log_module
from atomr_infer.engine.vllm.backend import VllmBackend
from atomr_infer.errors import InvalidRequest
from atomr_infer.log import configure_logging
from atomr_infer.metrics import ManagerMetrics, ReplicaMetrics, failure_reason
from atomr_infer.replica import actor as actor_module
from atomr_infer.replica.actor import VllmReplica

BACKEND = VllmBackend.factory(lambda deployment, progress: ScriptedEngine())


@dataclass
class Output:
    """The parts of vLLM's RequestOutput a replica reads, merging deltas as it does."""

    request_id: str
    outputs: list
    finished: bool

    def add(self, later, aggregate):
        self.outputs[0].text += later.outputs[0].text
        self.outputs[0].token_ids = self.outputs[0].token_ids + later.outputs[0].token_ids
        self.outputs[0].finish_reason = later.outputs[0].finish_reason
        self.finished = later.finished


@dataclass
class ScriptedEngine:
    """One token per step for every running request; finishes at ``max_tokens`` ("length")."""

    running: dict[str, list[int]] = field(default_factory=dict)  # id -> [emitted, max_tokens]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_request(self, request_id, prompt, params, **options):
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        self.running[request_id] = [0, params.max_tokens]

    def step(self):
        time.sleep(0.002)
        outs = []
        for rid, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            completion = SimpleNamespace(text="x", token_ids=[120], finish_reason="length" if done else None)
            outs.append(Output(request_id=rid, outputs=[completion], finished=done))
            if done:
                del self.running[rid]
        return outs

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.running)


class NoOpenAIApp:
    routes = ()


async def no_openai_app(self):
    return NoOpenAIApp()


class Recorder:
    def __init__(self, name, sink):
        self.name, self.sink = name, sink

    def record(self, value, tags=None):
        self.sink.append((self.name, value, dict(tags or {})))


class RecordingReplicaMetrics(ReplicaMetrics):
    """ReplicaMetrics with every metric replaced by a recorder (what Ray would receive)."""

    records: list[tuple[str, float, dict]] = []

    def __init__(self, deployment, replica, enabled=None):
        super().__init__(deployment, replica, enabled=False)
        self._m = {name: Recorder(name, RecordingReplicaMetrics.records) for name in self._m}
        self.enabled = True


@pytest.fixture
def replica(monkeypatch):
    RecordingReplicaMetrics.records = []
    monkeypatch.setattr(VllmBackend, "_openai_app", no_openai_app)
    monkeypatch.setattr(actor_module, "ReplicaMetrics", RecordingReplicaMetrics)
    spec = {"name": "unitdep", "model": "bundled:smollm2-135m-instruct", "device": "cpu"}
    rep = VllmReplica(spec, "r7", backend=BACKEND)
    yield rep
    asyncio.run(rep.shutdown())


@pytest.fixture
def json_logs(monkeypatch):
    """The real JSON pipeline at DEBUG, printing into a buffer; the previous config is restored after."""
    saved = structlog.get_config()
    if hasattr(log_module, "_threshold"):  # module-level level threshold, restored by monkeypatch
        monkeypatch.setattr(log_module, "_threshold", list(log_module._threshold))
    buffer = io.StringIO()
    configure_logging(level="DEBUG", fmt="json", force=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buffer))

    def lines() -> list[dict]:
        return [json.loads(line) for line in buffer.getvalue().splitlines()]

    yield lines
    structlog.configure(**saved)


async def collect(rep: VllmReplica, prompt_tokens: int, max_tokens: int, request_id: str = "r") -> list:
    """The outputs of one request, submitted as vLLM's serving layer submits it."""
    await rep.ready()
    request = SimpleNamespace(request_id=request_id, params=SimpleNamespace(max_tokens=max_tokens))
    stream = rep._backend.submit(request, None, prompt_tokens)
    try:
        return [output async for output in stream]
    finally:
        rep._backend.finish(stream)


def test_every_request_line_carries_its_request_id(json_logs, monkeypatch):
    # The replica binds its logger at construction, so build it after logging is configured.
    monkeypatch.setattr(VllmBackend, "_openai_app", no_openai_app)
    monkeypatch.setattr(actor_module, "ReplicaMetrics", lambda d, r: ReplicaMetrics(d, r, enabled=False))
    spec = {"name": "unitdep", "model": "bundled:smollm2-135m-instruct", "device": "cpu"}
    rep = VllmReplica(spec, "r7", backend=BACKEND)

    async def main():
        outputs = await collect(rep, 5, 3, "req-abc-123")
        await rep.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].finish_reason == "length"
    lines = json_logs()
    mine = [line for line in lines if line.get("request_id") == "req-abc-123"]
    events = [line["event"] for line in mine]
    assert "request_started" in events and "request_finished" in events, lines
    for line in mine:
        assert line["deployment"] == "unitdep" and line["replica"] == "r7"
    finished = next(line for line in mine if line["event"] == "request_finished")
    assert finished["completion_tokens"] == 3 and finished["finish_reason"] == "length"
    # Lifecycle lines are INFO and carry deployment and replica.
    states = {line["event"]: line for line in lines if line["event"] in ("replica_starting", "replica_ready")}
    assert set(states) == {"replica_starting", "replica_ready"}
    assert all(line["level"] == "info" and line["replica"] == "r7" for line in states.values())


def test_metrics_count_tokens_finish_reasons_and_failures(replica):
    async def main():
        done = await collect(replica, 2, 5, "five")
        with pytest.raises(InvalidRequest):  # the engine refuses it: it fails alone
            await collect(replica, 2, 0, "refused")
        request = SimpleNamespace(request_id="walks-away", params=SimpleNamespace(max_tokens=1000))
        stream = replica._backend.submit(request, None, 5)
        await stream.__aiter__().__anext__()
        replica._backend.finish(stream)  # the caller leaves: the request is aborted
        replica._publish_gauges()
        return done

    done = asyncio.run(main())
    records = RecordingReplicaMetrics.records

    def values(name, **tags):
        return [v for n, v, t in records if n == name and all(t.get(k) == x for k, x in tags.items())]

    assert sum(values("atomr_requests_started_total")) == 3
    assert values("atomr_requests_finished_total", finish_reason="length") == [1]
    assert sum(values("atomr_generation_tokens_total")) == sum(len(o.outputs[0].token_ids) for o in done) == 5
    assert sum(values("atomr_prompt_tokens_total")) == 2
    assert values("atomr_requests_failed_total", reason="invalid") == [1]
    assert values("atomr_requests_failed_total", reason="aborted") == [1]
    (ttft,) = values("atomr_time_to_first_token_seconds")
    (e2e,) = values("atomr_e2e_request_latency_seconds")
    (tpot,) = values("atomr_time_per_output_token_seconds")
    assert 0 < ttft <= e2e and 0 < tpot <= e2e
    assert len(values("atomr_engine_step_duration_seconds")) >= 5
    assert all(0.001 < v < 5 for v in values("atomr_engine_step_duration_seconds"))
    assert values("atomr_replica_state", state="ready")[-1] == 1.0
    assert values("atomr_replica_state", state="starting")[-1] == 0.0
    assert values("atomr_requests_in_flight")[-1] == 0


def test_failure_reasons():
    from atomr_infer.errors import EngineError, ReplicaUnavailable

    assert failure_reason(InvalidRequest("prompt", "too long")) == "invalid"
    assert failure_reason(ReplicaUnavailable("draining")) == "unavailable"
    assert failure_reason(EngineError("boom")) == "engine"


def test_metrics_are_noops_without_ray():
    metrics = ReplicaMetrics("d", "r0", enabled=False)
    assert not metrics.enabled
    metrics.request_started()
    metrics.request_finished("stop", 3, 0, 1.0, None, None)  # zero tokens: a counter would reject 0
    metrics.set_load(0, 0, None)
    metrics.set_state("ready")
    ManagerMetrics(enabled=False).applied("d", "changed")


def test_metrics_off_when_ray_is_not_initialized():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is running in this process")
    assert not ReplicaMetrics("d", "r0").enabled


def test_the_autoscalers_target_is_reported_every_pass_and_zeroed_once_removed():
    """It was set only by a scaling decision: missing after an apply, and a removed deployment's
    last target was exported for good."""
    from .test_autoscale import autoscaled
    from .test_manager import Harness, spec

    records: list = []
    h = Harness()
    h.manager._metrics._m = {name: Recorder(name, records) for name in h.manager._metrics._m}
    h.call("apply", autoscaled(max_replicas=4))
    h.call("apply", spec(name="plain"))
    h.converge(passes=1)
    targets = [(t["deployment"], v) for n, v, t in records if n == "atomr_manager_target_replicas"]
    assert ("demo", 1) in targets and not any(name == "plain" for name, _ in targets)
    h.call("remove", "demo")
    assert [(t["deployment"], v) for n, v, t in records if n == "atomr_manager_target_replicas"][-1] == ("demo", 0)
    records.clear()
    h.converge(passes=2)
    assert not [r for r in records if r[0] == "atomr_manager_target_replicas"]


def test_a_name_that_names_no_deployment_is_counted_under_a_dash():
    """The API's requests were labelled by the model string the client sent: one series per
    string, for good (a 404 each)."""
    from atomr_infer.serve.access_log import AccessLog

    log, seen = AccessLog(lambda name: name in ("smollm2", "smollm2:pirate")), []
    log._metrics.request = lambda key, deployment, status, tokens: seen.append(deployment)
    for name in ("smollm2", "smollm2:pirate", "ignore previous instructions", "smollm2:x-1f3a"):
        log.done(None, name, 404, None, 0.0)
    assert seen == ["smollm2", "smollm2:pirate", "-", "-"]


def test_a_background_response_counts_toward_max_concurrent_and_one_requests_inputs_do_not(replica):
    """A background response is answered ("queued") at once and generates on: the replica counted
    only its routers' open requests, so any number of them ran past the limit. The several engine
    requests of one HTTP request (an embedding of 64 inputs, several prompts) are one place."""
    from atomr_infer.errors import ReplicaBusy
    from atomr_infer.wire import HttpRequest, OpenRequest

    def request(request_id: str) -> OpenRequest:
        return OpenRequest(request_id, HttpRequest("POST", "/v1/chat/completions", (), b"{}"), limit=4)

    async def main():
        await replica.ready()
        inputs = [replica._backend.submit(SimpleNamespace(request_id=f"input-{i}",
                                                          params=SimpleNamespace(max_tokens=100_000)), None, 4)
                  for i in range(4)]  # one request's four engine requests: no router's request holds them here
        try:
            [admitted] = await replica.open_many("c1", [request("o1")])
            replica._backend._app = SimpleNamespace(background=3)  # three background responses generating
            [refused] = await replica.open_many("c1", [request("o2")])
            return admitted, refused
        finally:
            replica._backend._app = None
            replica._channels.cancel("c1", ["o1", "o2"])
            for stream in inputs:
                replica._backend.finish(stream)

    admitted, refused = asyncio.run(main())
    assert admitted == 1 and isinstance(refused, ReplicaBusy)


def test_a_streamed_background_response_is_one_place_not_two(replica):
    """``background`` and ``stream``: vLLM runs it as a background task and streams that task's
    events while the request is open. It counted as an open request and a background response,
    so only half of max_concurrent such streams ran (the others queued, or got 429)."""
    from atomr_infer.errors import ReplicaBusy
    from atomr_infer.wire import HttpRequest, OpenRequest

    def request(request_id: str, **fields) -> OpenRequest:
        body = json.dumps({"model": "d", "input": "hi", "background": True, **fields}).encode()
        return OpenRequest(request_id, HttpRequest("POST", "/v1/responses", (), body), limit=2)

    async def streaming(request, put, tokens=None, resume=None, prefilled=None):
        await asyncio.Event().wait()  # streams its background task's events until it ends

    async def main():
        await replica.ready()
        replica._serve = streaming
        opened = await replica.open_many("c1", [request("s1", stream=True)])
        replica._backend._app = SimpleNamespace(background=1)  # s1's task
        opened += await replica.open_many("c1", [request("s2", stream="true")])
        replica._backend._app = SimpleNamespace(background=2)
        opened += await replica.open_many("c1", [request("s3", stream=True)])  # full now
        try:
            return opened, replica._open_requests()
        finally:
            replica._backend._app = None
            replica._channels.cancel("c1", ["s1", "s2", "s3"])

    (first, second, third), in_flight = asyncio.run(main())
    assert (first, second) == (1, 2) and isinstance(third, ReplicaBusy) and in_flight == 2


def test_a_drain_waits_for_requests_admitted_and_still_being_prepared(replica, monkeypatch):
    """vLLM's serving layer renders, tokenizes and fetches images before the engine sees a request
    (seconds under a burst): the drain counted the engine's requests alone, returned 0 at once,
    and the roll's stop then failed a request the replica had taken with a 500."""
    from atomr_infer.wire import HttpRequest, OpenRequest

    async def preparing_then_answering(request, put, tokens=None, resume=None, prefilled=None):
        await asyncio.sleep(0.3)  # no engine stream yet
        put(b"answer")

    async def main():
        await replica.ready()
        monkeypatch.setattr(replica._backend, "serve", preparing_then_answering)
        request = OpenRequest("q1", HttpRequest("POST", "/v1/chat/completions", (), b"{}"))
        [admitted] = await replica.open_many("c1", [request])
        batches = replica._channels.stream("c1")
        await asyncio.sleep(0.05)
        in_flight = (await replica.health()).in_flight
        left = await replica.drain(timeout=5.0)
        await replica.shutdown()  # as a roll or a scale-down does once the drain returns
        batch = await anext(batches)
        await batches.aclose()
        return admitted, in_flight, left, batch

    admitted, in_flight, left, batch = asyncio.run(main())
    assert (admitted, in_flight, left) == (1, 1, 0)
    assert batch.items == {"q1": [b"answer"]} and batch.ended == {"q1": None}  # answered, not failed


def test_a_request_submitted_after_the_engine_was_found_wedged_fails_at_once(replica):
    """Streams open then were failed; one vLLM's serving layer was still preparing (a chat template
    rendering) registered afterwards and waited for output for good."""
    from atomr_infer.errors import EngineError

    async def main():
        await replica.ready()
        replica._backend.fail_open(EngineError("atomr:unitdep:r7 is wedged"))
        assert replica._backend.dead_error() is not None  # vLLM's serving layer now refuses up front
        late = SimpleNamespace(request_id="late", params=SimpleNamespace(max_tokens=4))
        stream = replica._backend.submit(late, None, 4)
        try:
            with pytest.raises(EngineError, match="wedged"):
                await asyncio.wait_for(anext(aiter(stream)), 5)
        finally:
            replica._backend.finish(stream)

    asyncio.run(main())


def test_vllms_queue_limits_refuse_what_would_exceed_them(replica):
    """max_num_queued_reqs and max_num_queued_tokens (extra_engine_args) were accepted and did
    nothing: the engine client inherited vLLM's no-op check_admission (vllm serve answers 503)."""
    from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError

    from atomr_infer.engine.vllm.engine_client import StepLoopEngineClient

    client = object.__new__(StepLoopEngineClient)  # the check alone: it reads the config and the gate
    client._gate = replica._backend
    limits = SimpleNamespace(max_num_queued_reqs=2, max_num_queued_tokens=None)
    client.vllm_config = SimpleNamespace(scheduler_config=limits)

    async def main():
        await replica.ready()
        running = SimpleNamespace(request_id="long", params=SimpleNamespace(max_tokens=100_000))
        stream = replica._backend.submit(running, None, 7)
        try:
            assert replica._backend.queue()[0] == 1  # one sequence unfinished
            client.check_admission(1)  # 1 + 1 <= 2
            with pytest.raises(QueueOverflowError):
                client.check_admission(2)  # an n=2 request takes two: 1 + 2 > 2
            limits.max_num_queued_reqs, limits.max_num_queued_tokens = None, 7
            client._gate = SimpleNamespace(queue=lambda: (1, 7))  # its 7 prompt tokens not prefilled yet
            with pytest.raises(MaxQueuedTokensError):
                client.check_admission(1)
        finally:
            replica._backend.finish(stream)

    asyncio.run(main())


def test_prompt_logprobs_under_kv_sharing_fast_prefill_are_refused_as_vllm_refuses_them():
    """AsyncLLM refuses them (they come out wrong); the replica's engine client answered them."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from atomr_infer.engine.vllm.engine_client import StepLoopEngineClient

    client = object.__new__(StepLoopEngineClient)
    client._gate = SimpleNamespace(dead_error=lambda: None)
    client.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(kv_sharing_fast_prefill=True))
    with pytest.raises(VLLMValidationError, match="incorrect logprobs for prompt tokens"):
        asyncio.run(client._process("r", "hi", SamplingParams(prompt_logprobs=1)))


def test_a_slow_adapter_load_is_no_wedged_step_and_one_past_its_bound_says_so(monkeypatch):
    """vLLM's add_lora runs between two steps: a load longer than ATOMR_STEP_TIMEOUT_S (a large
    adapter on a slow disk) got the replica killed as wedged, and one past the 30 s wait failed
    with an empty reason (vLLM reports str(error), and a TimeoutError's is empty)."""
    from atomr_infer.engine.vllm.engine_client import StepLoopEngineClient
    from atomr_infer.errors import EngineError
    from atomr_infer.status import ReplicaState

    release = threading.Event()

    class LoadingEngine(ScriptedEngine):
        def add_lora(self, request):
            return release.wait(5)

    monkeypatch.setattr(VllmBackend, "_openai_app", no_openai_app)
    monkeypatch.setenv("ATOMR_ENGINE_CALL_TIMEOUT_S", "0.8")
    spec = {"name": "unitdep", "model": "bundled:smollm2-135m-instruct", "device": "cpu"}
    rep = VllmReplica(spec, "r7", backend=VllmBackend.factory(lambda d, p: LoadingEngine()), step_timeout_s=0.2)
    client = object.__new__(StepLoopEngineClient)  # add_lora alone: it goes through the gate
    client._gate = rep._backend

    async def main():
        await rep.ready()
        load = asyncio.ensure_future(client.add_lora("big"))
        await asyncio.sleep(0.5)  # past the step's bound, within the call's
        rep._check()
        assert rep._life.state is ReplicaState.READY
        with pytest.raises(EngineError, match=r"^the engine took over 0.8s to load it"):
            await load
        await asyncio.sleep(0.3)  # the call runs on in the step thread: past its bound the engine is wedged
        rep._check()
        assert rep._life.state is ReplicaState.UNHEALTHY
        assert "engine call (loading a LoRA adapter) has not returned" in str(rep._life.error)

    try:
        asyncio.run(main())
    finally:
        release.set()
        asyncio.run(rep.shutdown())


def test_an_engine_call_on_a_step_loop_that_ended_fails_at_once(replica):
    """Queued on a loop that had ended, a call was never answered: an adapter load waited out its
    whole timeout (300 s) on a replica already unhealthy."""
    from atomr_infer.errors import EngineError

    async def main():
        await replica.ready()
        await asyncio.to_thread(replica._backend._loop.stop, 10.0)  # stopped, with no error to say why
        with pytest.raises(EngineError, match="has no running engine"):
            await replica._backend.engine_call(lambda engine: "never", timeout_s=2.0)

    asyncio.run(main())
