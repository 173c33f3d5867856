"""``VllmBackend``: the engine interface (engine/backend.py) over vLLM.

Threads: the replica's event loop calls it; one ``StepLoop`` thread builds and drives the
engine. Requests enter through the loop's inbox; each engine step's outputs come back with a
single ``call_soon_threadsafe`` (``LoopHandoff``) and are spread over the per-request streams
(``OpenStreams``), each registered *before* its request is submitted. vLLM's own OpenAI server
(``OpenAIApp``) runs over ``StepLoopEngineClient``, which submits here (``submit``/``finish``:
the engine client's ``RequestGate``), so every field ``vllm serve`` accepts works.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from atomr_infer.engine.backend import BackendContext, EngineFacts, EngineHealth, EngineStats, Prefilled, Put, TokenSink
from atomr_infer.engine.vllm import adapters
from atomr_infer.engine.vllm.coalesce import coalesce_core_outputs
from atomr_infer.engine.vllm.core_failure import CoreStartFailed
from atomr_infer.engine.vllm.engine_info import engine_memory, engine_unfinished, start_failure_recurs
from atomr_infer.engine.vllm.engine_metrics import SchedulerGauges, stat_loggers
from atomr_infer.engine.vllm.handoff import LoopHandoff
from atomr_infer.engine.vllm.kv_events import FullReports, kv_event_source, renders_key
from atomr_infer.engine.vllm.open_streams import OpenStreams
from atomr_infer.engine.vllm.openai_app import OpenAIApp
from atomr_infer.engine.vllm.prefill_watch import PREFILLED, PrefillWatch
from atomr_infer.engine.vllm.resume import RESUME, TOKENS
from atomr_infer.engine.vllm.step_loop import Engine, StepLoop
from atomr_infer.engine.vllm.stream import RequestStream
from atomr_infer.errors import EngineError, EngineStartFailed, InvalidRequest
from atomr_infer.spec import Deployment
from atomr_infer.wire import HttpRequest

EngineFactory = Callable[[Deployment, Callable[[str], None]], Engine]
OPERATOR_CALL_TIMEOUT_S = 30.0  # an operator's call waits for the current step to end, then runs


def _build_engine(deployment: Deployment, progress: Callable[[str], None], replica: str,
                  gauges: SchedulerGauges) -> Engine:
    from atomr_infer.engine.vllm.engine_args import build_vllm_engine

    return build_vllm_engine(deployment, progress, stat_loggers(deployment, replica, gauges))


class VllmBackend:
    def __init__(self, context: BackendContext, engine_factory: EngineFactory | None = None) -> None:
        self._ctx = context
        self._deployment = context.deployment
        self._gauges = SchedulerGauges()  # what vLLM's stat loggers last recorded: the default engine's only
        factory = engine_factory or functools.partial(_build_engine, replica=context.name, gauges=self._gauges)
        self._handoff = LoopHandoff()
        self._engine: Engine | None = None
        self._facts = EngineFacts()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._on_failure: Callable[[BaseException], None] = lambda _exc: None
        self._app: OpenAIApp | None = None
        self._client: Any = None
        self._app_lock = asyncio.Lock()
        self._full_reports: FullReports | None = None  # once the engine is up, where it publishes KV events
        metrics = context.metrics
        self._prefill_watch = PrefillWatch(self._handoff.call)
        self._loop = StepLoop(
            engine_factory=lambda: factory(self._deployment, context.progress),
            on_ready=self._on_engine_ready,
            on_outputs=lambda outputs: self._handoff.outputs(self._streams.dispatch, outputs),
            on_error=self._on_loop_error,
            on_rejected=self._on_rejected,
            name=f"atomr-step-loop-{context.name}",
            on_step=metrics.engine_step if metrics.enabled else None,
            after_step=self._prefill_watch.after_step,
        )
        self._streams = OpenStreams(self._loop, context.stats, metrics, context.log)

    @classmethod
    def factory(cls, engine_factory: EngineFactory) -> Callable[[BackendContext], VllmBackend]:
        """A replica's ``backend`` over another engine (the emulated one, a test's)."""
        return lambda context: cls(context, engine_factory)

    @staticmethod
    def validate(deployment: Deployment) -> None:
        """The spec's vLLM settings against the vLLM installed here, read from its source
        without importing it (spec_check.py): cheap enough for the manager's process."""
        from atomr_infer.engine.vllm.spec_check import check_spec

        check_spec(deployment)

    # -- step-loop thread callbacks ---------------------------------------------------------

    def _on_engine_ready(self, engine: Engine) -> None:
        # Before the first step: a core in its own process (GPU) hands over every step it has
        # finished at once, so output processing never falls behind it (coalesce.py).
        self._handoff.paced = coalesce_core_outputs(engine)
        if self._handoff.paced:
            self._ctx.log.info("coalescing_core_outputs")
        self._engine = engine
        model_config = getattr(engine, "model_config", None)
        max_len = getattr(model_config, "max_model_len", None) or self._deployment.runtime_config.max_model_len
        harmony = getattr(getattr(model_config, "hf_config", None), "model_type", None) == "gpt_oss"  # as vLLM's chat
        kv_events = kv_event_source(engine)
        if kv_events is not None:  # what routers key the tokenizer they fetch from here by
            kv_events["renders"] = renders_key(self._deployment)
            self._full_reports = FullReports()
        self._facts = EngineFacts(max_model_len=max_len, kv_events=kv_events, parses_output=harmony,
                                  **engine_memory(engine))
        self._started.set()

    def _on_loop_error(self, exc: BaseException) -> None:
        if not self._started.is_set():
            self._start_error = exc
            self._started.set()
            self._handoff.call(self._on_failure, exc)
            return
        # The replica hears first: it closes its channels before the streams fail, so routers
        # move or retry those requests rather than read this engine's error (replica/actor.py).
        self._handoff.call(self._on_failure, exc)
        error = EngineError(f"engine failed on {self._ctx.name}: {type(exc).__name__}: {exc}")
        self._handoff.call(self._streams.fail_all, error)

    def _on_rejected(self, request_id: str, exc: BaseException) -> None:
        error: BaseException = InvalidRequest("prompt", str(exc)) if isinstance(exc, ValueError) else exc
        self._handoff.call(self._streams.fail_one, request_id, error)

    # -- the engine interface ---------------------------------------------------------------

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        self._on_failure = on_failure
        self._loop.start()

    def bind_loop(self) -> None:
        """The replica's event loop, where step outputs are handed over (called from it)."""
        self._handoff.loop = self._handoff.loop or asyncio.get_running_loop()

    async def wait_started(self, timeout: float | None) -> EngineFacts:
        self.bind_loop()
        if not self._started.is_set() and not await asyncio.to_thread(self._started.wait, timeout):
            raise EngineError(f"{self._ctx.name} did not start within {timeout:.0f}s")
        if self._start_error is not None:
            err = self._start_error
            cause = str(err) if isinstance(err, CoreStartFailed) else f"{type(err).__name__}: {err}"
            message = f"{self._ctx.name} failed to start: {cause}"
            raise EngineStartFailed(message, start_failure_recurs(err))
        try:
            app = await self._openai_app()
        except Exception as exc:
            raise EngineStartFailed(f"{self._ctx.name}: vLLM's OpenAI server failed to start: {exc!r}") from None
        return dataclasses.replace(self._facts, routes=app.routes)

    async def _openai_app(self) -> OpenAIApp:
        async with self._app_lock:
            if self._app is None:
                from atomr_infer.engine.vllm.engine_client import StepLoopEngineClient

                assert self._engine is not None  # set before the started event
                self._client = StepLoopEngineClient(self._engine, self)
                self._app = await OpenAIApp.build(self._client, self._deployment, self._engine.model_config.model)
                self._ctx.log.info("openai_app_ready")
        return self._app

    async def serve(
        self, request: HttpRequest, put: Put, tokens: TokenSink | None = None, resume: list[int] | None = None,
        prefilled: Prefilled | None = None,
    ) -> None:
        app = self._app or await self._openai_app()
        reset = TOKENS.set(tokens) if tokens is not None else None
        resuming = RESUME.set(resume) if resume is not None else None
        watching = PREFILLED.set(prefilled) if prefilled is not None else None
        try:
            await app.run(request, put)
        finally:
            if reset is not None:
                TOKENS.reset(reset)
            if resuming is not None:
                RESUME.reset(resuming)
            if watching is not None:
                PREFILLED.reset(watching)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        if self._client is None:  # built with the app, once
            await self._openai_app()
        async for output in self._client.generate(prompt, params, request_id):
            yield output

    def abort(self, request_ids: list[str]) -> None:
        self._loop.abort(request_ids)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self.engine_call(lambda engine: engine.reset_prefix_cache(reset_running_requests)))

    def health(self) -> EngineHealth:
        error = self._start_error or self._loop.error
        alive = self._loop.alive or not self._started.is_set()
        return EngineHealth(error=error, stuck_for=self._loop.stuck_for(), in_call_for=self._loop.in_call_for(),
                            alive=alive)

    def stats(self) -> EngineStats:
        kv_usage, waiting = self._gauges.read()
        return EngineStats(kv_cache_usage=kv_usage, waiting=waiting, steps=self._loop.steps,
                           unfinished=engine_unfinished(self._engine))

    def background_requests(self) -> int:
        return self._app.background if self._app is not None else 0

    def open_requests(self) -> tuple[int, int]:
        return len(self._streams), self._streams.waiting

    def fail_open(self, error: BaseException) -> None:
        """Fail every open request with ``error`` (the replica found the engine wedged)."""
        self._streams.fail_all(error)

    async def load_adapter(self, name: str, path: str) -> None:
        app = self._app or await self._openai_app()
        await adapters.load(app.models, name, path)

    async def unload_adapter(self, name: str) -> None:
        app = self._app or await self._openai_app()
        await adapters.unload(app.models, name)

    async def engine_call(self, fn: Callable[[Engine], Any], timeout_s: float = OPERATOR_CALL_TIMEOUT_S) -> Any:
        """``fn(engine)`` run by the step loop between two steps (the engine is its thread's);
        ``TimeoutError`` past ``timeout_s`` (the call itself runs on: a thread is not cancelled)."""
        if not self._started.is_set() or self._start_error is not None or not self._loop.alive:
            raise EngineError(f"{self._ctx.name} has no running engine")
        return await asyncio.wait_for(asyncio.wrap_future(self._loop.call(fn)), timeout_s)

    async def shutdown(self, error: BaseException) -> None:
        self._streams.fail_all(error)
        await asyncio.to_thread(self._loop.stop, 30.0)

    # -- the engine client's gate (engine_client.py): vLLM's serving layer submits here ------

    def submit(self, request: Any, prompt_text: str | None, prompt_tokens: int) -> RequestStream:
        # Unique on this replica, as vLLM's AsyncLLM makes them (assign_request_id): two requests
        # with one X-Request-Id or request_id (a client's retry while the first runs) both run.
        logged_id, request.request_id = request.request_id, f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        if self._full_reports is not None:  # a router that missed a cached prefix's events learns it
            self._full_reports.mark(request)
        stream = self._streams.open(
            request.request_id, prompt_tokens, request, request.params, logged_id, prompt_text=prompt_text
        )
        return stream

    def watch_prefill(self, stream: RequestStream, request: Any, callback: Prefilled) -> None:
        self._prefill_watch.add(stream.request_id, request, callback)

    def finish(self, stream: RequestStream) -> None:
        self._prefill_watch.forget(stream.request_id)
        self._streams.close(stream)

    def queue(self) -> tuple[int, int]:
        unfinished = engine_unfinished(self._engine)
        return (len(self._streams) if unfinished is None else unfinished), self._streams.prefilling_tokens()

    def dead_error(self) -> BaseException | None:
        """Why the engine takes no request (vLLM's serving layer then refuses it up front): it
        failed, was found wedged, or shut down."""
        error = self._loop.error or self._streams.failed
        return None if error is None else EngineError(f"{self._ctx.name} is unhealthy: {error!r}")
