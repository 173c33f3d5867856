"""``VllmReplica``: a Ray actor that owns one engine and streams its output to many callers.

Threads: Ray's event loop runs the actor methods; one ``StepLoop`` thread builds and drives
the engine. Requests enter through the loop's inbox; each engine step's outputs come back
with a single ``call_soon_threadsafe`` and are spread over the per-request streams. A stream
is registered *before* its request is submitted, so no output can arrive for an unknown id.

Routers reach it over channels (replica/channel.py, the methods in replica/channel_methods.py):
``open_many`` admits and starts requests, ``channel`` streams batches of every request a router
opened, ``cancel`` aborts. A request is one of two kinds, one engine and one step loop behind
both:
- ``http(HttpRequest)``: the OpenAI API. vLLM's own server app runs in the replica over an
  engine client that submits to the step loop (replica/openai_app.py, engine_client.py); the
  HTTP ingress and ``Client`` use it, so every field ``vllm serve`` accepts works.
- ``generate(request)``: token-level ``Chunk``s for a prompt or messages, with our own small
  request type. It needs only the four-method engine contract (engine/protocol.py), so an engine
  that is not vLLM, or a test's scripted engine, is served through it.

Both are also Ray streaming methods of their own (tests, benchmarks). Cancellation: cancelling
the request's task (``cancel``, a channel that went away, or ``ray.cancel`` of a direct call)
runs its ``finally``, which aborts the request in the engine at the start of the next loop
turn, i.e. within one engine step.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from atomr_infer.engine.coalesce import coalesce_core_outputs
from atomr_infer.engine.device import resolve_device
from atomr_infer.engine.protocol import Engine
from atomr_infer.errors import EngineError, EngineStartFailed, InvalidRequest, ReplicaUnavailable
from atomr_infer.log import get_logger
from atomr_infer.metrics import GAUGE_PERIOD_S, REPLICA_STATES, ReplicaMetrics, failure_reason
from atomr_infer.replica.channel import ChannelHub
from atomr_infer.replica.channel_methods import ChannelMethods
from atomr_infer.replica.engine_info import (
    engine_memory,
    engine_unfinished,
    kv_cache_usage,
    placement,
    start_failure_recurs,
)
from atomr_infer.replica.handoff import LoopHandoff
from atomr_infer.replica.open_streams import OpenStreams
from atomr_infer.replica.openai_app import HttpHead, HttpRequest, OpenAIApp
from atomr_infer.replica.periodic import run_every
from atomr_infer.replica.prompt import PromptBuilder
from atomr_infer.replica.request import Chunk, GenerateRequest, Usage, parse_request
from atomr_infer.replica.serving_process import tune_serving_process
from atomr_infer.replica.stats import ReplicaStats, StatsCollector
from atomr_infer.replica.step_loop import StepLoop
from atomr_infer.replica.stream import RequestStream
from atomr_infer.spec import Deployment, parse_deployment

EngineFactoryFor = Callable[[Deployment, Callable[[str], None]], Engine]

# A step-loop turn (taking submissions, one engine step, handing outputs over) that has not
# ended after this long means the engine is wedged: its streams fail and health() fails, so
# the manager replaces the replica. ATOMR_STEP_TIMEOUT_S overrides it (for engines whose
# single step can legitimately run longer, e.g. a huge prefill on a slow device).
DEFAULT_STEP_TIMEOUT_S = 30.0
WATCHDOG_PERIOD_S = 1.0


def _default_engine_factory(deployment: Deployment, progress: Callable[[str], None]) -> Engine:
    from atomr_infer.engine.vllm_engine import build_vllm_engine

    return build_vllm_engine(deployment, progress)


class VllmReplica(ChannelMethods):
    """One replica of a deployment. Create it with ``VllmReplicaActor.options(...).remote(...)``."""

    def __init__(
        self,
        deployment: Deployment | dict[str, Any],
        replica_id: str,
        engine_factory: EngineFactoryFor | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        self._deployment = parse_deployment(deployment)
        self._step_timeout_s = step_timeout_s or float(os.environ.get("ATOMR_STEP_TIMEOUT_S", DEFAULT_STEP_TIMEOUT_S))
        self._wedged: EngineError | None = None  # set by the watchdog when the loop stops moving
        self._replica_id = replica_id
        self._device = resolve_device(self._deployment)
        self._log = get_logger(__name__, deployment=self._deployment.name, replica=replica_id)
        self._channels = ChannelHub()
        self._stats = StatsCollector()
        self._metrics = ReplicaMetrics(self._deployment.name, replica_id)
        self._gauge_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._handoff = LoopHandoff()  # step-loop thread -> event loop (replica/handoff.py)
        self._draining = False
        self._stopped = False
        self._started_at = time.time()
        self._phase = "starting"
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._prompts: PromptBuilder | None = None
        self._max_model_len: int | None = None
        self._engine: Engine | None = None
        self._app: OpenAIApp | None = None  # vLLM's OpenAI server, built once the engine is up
        self._app_lock = asyncio.Lock()
        # Set once the engine is up: only a vLLM engine carries what vLLM's server needs (an
        # emulated one does too); test engines with the bare contract serve generate() alone.
        self._has_openai_app = False
        factory = engine_factory or _default_engine_factory
        self._loop = StepLoop(
            engine_factory=lambda: factory(self._deployment, self._progress),
            on_ready=self._on_engine_ready,
            on_outputs=self._on_outputs,
            on_error=self._on_loop_error,
            on_rejected=self._on_rejected,
            name=f"atomr-step-loop-{replica_id}",
            on_step=self._metrics.engine_step if self._metrics.enabled else None,
        )
        self._streams = OpenStreams(self._loop, self._stats, self._metrics, self._log)
        self._log.info("replica_starting", device=self._device, model=self._deployment.model)
        self._loop.start()

    def __repr__(self) -> str:
        return f"atomr:{self._deployment.name}:{self._replica_id} ({self._device})"

    # -- step-loop thread callbacks ---------------------------------------------------------

    def _progress(self, message: str) -> None:
        self._phase = message
        self._log.info("replica_start_progress", step=message)

    def _on_engine_ready(self, engine: Engine) -> None:
        # Before the first step: a core in its own process (GPU) hands over every step it has
        # finished at once, so output processing never falls behind it (engine/coalesce.py).
        self._handoff.paced = coalesce_core_outputs(engine)
        if self._handoff.paced:
            self._log.info("coalescing_core_outputs")
        self._engine = engine
        self._prompts = PromptBuilder(engine.get_tokenizer(), self._log)
        self._has_openai_app = all(hasattr(engine, a) for a in ("vllm_config", "input_processor", "renderer"))
        model_config = getattr(engine, "model_config", None)
        self._max_model_len = getattr(model_config, "max_model_len", None) or (
            self._deployment.runtime_config.max_model_len
        )
        self._phase = "ready"
        self._log.info("replica_ready", max_model_len=self._max_model_len, start_s=round(self._uptime(), 1))
        self._ready.set()

    def _on_outputs(self, outputs: list[Any]) -> None:
        self._handoff.outputs(self._streams.dispatch, outputs)

    def _on_loop_error(self, exc: BaseException) -> None:
        if not self._ready.is_set():
            self._start_error = exc
            self._phase = "failed"
            self._log.error("replica_start_failed", error=repr(exc))
            self._ready.set()
            return
        self._phase = "unhealthy"
        self._log.error("engine_failed", error=repr(exc), open_streams=len(self._streams))
        error = EngineError(f"engine failed on {self!r}: {type(exc).__name__}: {exc}")
        self._handoff.call(self._streams.fail_all, error)

    def _on_rejected(self, request_id: str, exc: BaseException) -> None:
        error: BaseException = InvalidRequest("prompt", str(exc)) if isinstance(exc, ValueError) else exc
        self._handoff.call(self._streams.fail_one, request_id, error)

    # -- event-loop side --------------------------------------------------------------------

    def _uptime(self) -> float:
        return time.time() - self._started_at

    def _publish_gauges(self) -> None:
        self._metrics.set_load(len(self._streams), self._streams.waiting, kv_cache_usage(self._engine))
        phase = "unhealthy" if self._phase == "failed" else self._phase
        self._metrics.set_state(phase if phase in REPLICA_STATES else "starting")

    def _check_progress(self) -> None:
        """The watchdog's check: close the channels of routers that are gone, and fail
        everything if the step loop stopped moving."""
        for channel_id in self._channels.expire():
            self._log.warning("channel_expired", channel=channel_id, reason="its router was not heard from")
        if self._wedged is not None or self._stopped:
            return
        stuck = self._loop.stuck_for()
        if stuck <= self._step_timeout_s:
            return
        self._wedged = EngineError(
            f"{self!r} is wedged: its engine step has not returned for {stuck:.0f}s "
            f"(limit {self._step_timeout_s:g}s, ATOMR_STEP_TIMEOUT_S)"
        )
        self._phase = "unhealthy"
        self._log.error("engine_wedged", stuck_s=round(stuck, 1), open_streams=len(self._streams))
        self._streams.fail_all(self._wedged)

    async def _wait_ready(self, timeout: float | None) -> None:
        aloop = self._handoff.loop = self._handoff.loop or asyncio.get_running_loop()
        if self._gauge_task is None and self._metrics.enabled:
            self._gauge_task = aloop.create_task(
                run_every(weakref.ref(self), GAUGE_PERIOD_S, VllmReplica._publish_gauges)
            )
        if self._watchdog_task is None:
            self._watchdog_task = aloop.create_task(
                run_every(weakref.ref(self), WATCHDOG_PERIOD_S, VllmReplica._check_progress)
            )
        if not self._ready.is_set():
            ok = await asyncio.to_thread(self._ready.wait, timeout)
            if not ok:
                raise EngineError(f"{self!r} did not start within {timeout:.0f}s (now: {self._phase})")
        if self._start_error is not None:
            err = self._start_error
            raise EngineStartFailed(f"{self!r} failed to start: {type(err).__name__}: {err}", start_failure_recurs(err))

    # -- actor API --------------------------------------------------------------------------

    async def ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Resolve once the engine and vLLM's server app have started; raise ``EngineError`` if
        either failed or the engine timed out."""
        await self._wait_ready(timeout)
        if self._has_openai_app:
            try:
                await self._openai_app()
            except Exception as exc:
                raise EngineStartFailed(f"{self!r}: vLLM's OpenAI server failed to start: {exc!r}") from None
        tune_serving_process()  # started: what exists now lives as long as the process
        return {
            "replica_id": self._replica_id,
            "device": self._device,
            "max_model_len": self._max_model_len,
            **engine_memory(self._engine),
            **placement(),
        }

    def _admit(self) -> None:
        """Raise unless this replica takes new requests (the router retries ReplicaUnavailable)."""
        if self._draining or self._stopped:
            raise ReplicaUnavailable(f"{self!r} is {'stopped' if self._stopped else 'draining'}")
        if self._loop.error is not None:
            raise EngineError(f"{self!r} is unhealthy: {self._loop.error!r}")
        if self._wedged is not None:
            raise EngineError(f"{self!r} is unhealthy: {self._wedged}")

    # The engine client's gate (replica/engine_client.py): vLLM's serving layer submits here.
    def submit(self, request: Any, prompt_text: str | None, prompt_tokens: int) -> RequestStream:
        return self._streams.open(request.request_id, prompt_tokens, request, request.params, prompt_text=prompt_text)

    def finish(self, stream: RequestStream) -> None:
        self._streams.close(stream)

    def dead_error(self) -> BaseException | None:
        if self._loop.error is not None or self._wedged is not None:
            return EngineError(f"{self!r} is unhealthy: {self._wedged or self._loop.error!r}")
        return None

    async def generate(self, request: GenerateRequest | dict[str, Any]) -> AsyncIterator[Chunk]:
        """Stream ``Chunk``s for one request. Call as a Ray streaming generator."""
        req: GenerateRequest | None = None
        try:
            req = parse_request(request)
            self._admit()
            await self._wait_ready(None)
            self._admit()
            assert self._prompts is not None  # set before the ready event
            prompt_ids = self._prompts.token_ids(req)
            params = self._prompts.sampling_params(req, len(prompt_ids), self._max_model_len)
            prompt = {"prompt_token_ids": prompt_ids}
            stream = self._streams.open(req.request_id or uuid.uuid4().hex, len(prompt_ids), prompt, params)
        except Exception as exc:
            self._metrics.request_failed(failure_reason(exc))
            self._log.debug("request_rejected", request_id=req and req.request_id, error=str(exc))
            raise
        try:
            async for out in stream:
                completion = out.outputs[0]
                finish = (completion.finish_reason or "stop") if out.finished else None
                usage = Usage(stream.prompt_tokens, stream.completion_tokens) if finish else None
                yield Chunk(completion.text, list(completion.token_ids), finish, usage)
        finally:
            self._streams.close(stream)

    async def http(self, request: HttpRequest) -> AsyncIterator[HttpHead | bytes]:
        """One OpenAI API request, answered by vLLM's own server app: its head, then its body
        as sent (SSE events while streaming). Call as a Ray streaming generator."""
        self._admit()
        await self._wait_ready(None)
        self._admit()
        app = await self._openai_app()
        async for item in app.call(request):
            yield item

    async def _openai_app(self) -> OpenAIApp:
        async with self._app_lock:
            if self._app is None:
                from atomr_infer.replica.engine_client import StepLoopEngineClient

                assert self._engine is not None
                client = StepLoopEngineClient(self._engine, self)
                self._app = await OpenAIApp.build(client, self._deployment, self._engine.model_config.model)
                self._log.info("openai_app_ready")
        return self._app

    async def health(self) -> dict[str, Any]:
        """Raise ``EngineError`` if the engine failed or a step is stuck; else report the phase."""
        if self._start_error is not None:
            raise EngineError(f"{self!r} failed to start: {self._start_error!r}")
        if self._loop.error is not None:
            raise EngineError(f"{self!r} engine failed: {self._loop.error!r}")
        if self._ready.is_set() and not self._loop.alive and not self._stopped:
            raise EngineError(f"{self!r} step loop is not running")
        self._check_progress()
        if self._wedged is not None:
            raise self._wedged
        return {"phase": self._phase, "draining": self._draining, "in_flight": len(self._streams)}

    async def stats(self) -> ReplicaStats:
        return self._stats.snapshot(
            in_flight=len(self._streams),
            waiting=self._streams.waiting,
            phase=self._phase,
            uptime_s=self._uptime(),
            kv_cache_usage=kv_cache_usage(self._engine),
            steps=self._loop.steps,
            engine_unfinished=engine_unfinished(self._engine),
        )

    async def in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float = 30.0) -> int:
        """Stop taking requests and wait up to ``timeout`` s for in-flight ones. Returns how many remain."""
        self._draining = True
        self._phase = "draining"
        self._log.info("replica_draining", in_flight=len(self._streams))
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self._streams)

    async def shutdown(self) -> None:
        """Fail what is still open, stop the step loop and free the engine."""
        self._stopped, self._draining, self._phase = True, True, "stopped"
        self._streams.fail_all(ReplicaUnavailable(f"{self!r} was shut down"))
        await asyncio.to_thread(self._loop.stop, 30.0)
        if self._metrics.enabled:
            self._publish_gauges()
        self._log.info("replica_stopped")


def replica_actor_class() -> Any:
    """``VllmReplica`` as a Ray actor class (async, generous concurrency)."""
    import ray

    return ray.remote(max_concurrency=10_000, max_restarts=0)(VllmReplica)
