"""``VllmReplica``: a Ray actor that owns one engine backend and streams its answers to many routers.

The engine sits behind the interface of engine/backend.py (vLLM's, engine/vllm/, for every spec
today); the replica adds what is atomr's: its lifecycle (replica/lifecycle.py), admission
under ``serving.max_concurrent`` counted over every router, the channels routers read
(replica/channel.py, over the typed wire of wire.py), the watchdog that finds a wedged
engine, metrics and logs.

Routers call ``open_many`` (admit and start every request they opened in one turn of their
event loop), read ``channel`` (one stream of ``Batch``es per router), ``cancel`` and
``keepalive``. ``http`` answers one request as a Ray streaming call of its own (tests, tools).
The manager calls ``ready``, ``health``, ``stats``, ``drain`` and ``shutdown``. Cancellation:
cancelling a request's task (``cancel``, a channel that went away, ``ray.cancel`` of ``http``)
aborts it in the engine within one engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from atomr_infer.engine.backend import (
    BackendContext,
    EngineBackend,
    EngineStats,
    backend_class,
    engine_call_timeout_s,
)
from atomr_infer.engine.device import resolve_device
from atomr_infer.engine.stats import ReplicaStats, StatsCollector
from atomr_infer.errors import AtomrError, EngineError, EngineStartFailed, ReplicaUnavailable
from atomr_infer.log import get_logger
from atomr_infer.merging import MergingBuffer, join_bytes
from atomr_infer.metrics import GAUGE_PERIOD_S, ReplicaMetrics
from atomr_infer.models.adapters import resolve_adapter
from atomr_infer.replica.adapters import AdapterSet
from atomr_infer.replica.channel import ChannelHub
from atomr_infer.replica.lifecycle import Lifecycle, ReplicaHealth
from atomr_infer.replica.periodic import run_every
from atomr_infer.serving_process import tune_serving_process
from atomr_infer.spec import Deployment, parse_deployment
from atomr_infer.status import ReplicaState
from atomr_infer.wire import Batch, HttpHead, HttpRequest, OpenRequest

BackendFactory = Callable[[BackendContext], EngineBackend]

# A step-loop turn (taking submissions, one engine step, handing outputs over) that has not
# ended after this long means the engine is wedged: its streams fail and health() fails, so
# the manager replaces the replica. ATOMR_STEP_TIMEOUT_S overrides it (for engines whose
# single step can legitimately run longer, e.g. a huge prefill on a slow device). A call between
# steps (loading a LoRA adapter) has its own, longer bound: ATOMR_ENGINE_CALL_TIMEOUT_S.
DEFAULT_STEP_TIMEOUT_S = 30.0
WATCHDOG_PERIOD_S = 1.0


class VllmReplica:
    """One replica of a deployment. Create it with ``replica_actor_class().options(...).remote(...)``."""

    def __init__(
        self,
        deployment: Deployment | dict[str, Any],
        replica_id: str,
        backend: BackendFactory | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        self._deployment = parse_deployment(deployment)
        self._step_timeout_s = step_timeout_s or float(os.environ.get("ATOMR_STEP_TIMEOUT_S", DEFAULT_STEP_TIMEOUT_S))
        self._call_timeout_s = engine_call_timeout_s()
        self._replica_id = replica_id
        self._device = self._deployment.device  # until resolved: Ray prints repr(self) if that raises
        self._device = resolve_device(self._deployment)
        self._log = get_logger(__name__, deployment=self._deployment.name, replica=replica_id)
        self._life = Lifecycle(repr(self))
        self._channels = ChannelHub()
        self._stats = StatsCollector()
        self._metrics = ReplicaMetrics(self._deployment.name, replica_id)
        self._tasks: list[asyncio.Task[None]] = []  # the gauges and the watchdog, once a method ran
        self._facts: dict[str, Any] = {}
        context = BackendContext(
            self._deployment, f"{self._deployment.name}-{replica_id}", self._progress, self._stats, self._metrics,
            self._log,
        )
        self._backend: Any = (backend or backend_class(self._deployment))(context)
        cache_dir = self._deployment.runtime_config.hf_cache_dir
        self._adapters = AdapterSet(
            self._deployment.name, self._backend.load_adapter, self._backend.unload_adapter,
            lambda source: resolve_adapter(source, cache_dir),
        )
        self._log.info("replica_starting", device=self._device, model=self._deployment.model)
        self._backend.start(on_failure=self._engine_failed)

    def __repr__(self) -> str:
        return f"atomr:{self._deployment.name}:{self._replica_id} ({self._device})"

    @property
    def _stopped(self) -> bool:  # periodic.py's stop condition
        return self._life.state is ReplicaState.STOPPED

    # -- lifecycle --------------------------------------------------------------------------

    def _progress(self, message: str) -> None:  # from the step-loop thread, while starting
        if self._life.state is ReplicaState.STARTING:
            self._life.progress = message
        self._log.info("replica_start_progress", step=message)

    def _engine_failed(self, exc: BaseException) -> None:
        # A core process's own exception is named, not its wrapper's (engine/vllm/core_failure.py).
        kind = getattr(exc, "type_name", None) or type(exc).__name__
        if self._life.to(ReplicaState.UNHEALTHY, f"failed: {kind}", exc):
            self._log.error("engine_failed", error=repr(exc), open_requests=self._open_requests())
            self._channels.close_all(f"{kind}: {exc}")  # before the streams fail: routers move or re-run them

    def _open_requests(self) -> int:
        """Requests in the engine, or admitted and still being prepared (vLLM's serving layer
        renders, tokenizes, fetches images first), or generating in the background: a drain that
        counted the engine's alone let a roll stop a replica under requests it had taken."""
        in_engine = self._backend.open_requests()[0]
        return max(in_engine, self._channels.in_flight(self._backend.background_requests()))

    def _check(self) -> None:
        """The watchdog: close the channels of routers that are gone; mark the replica
        unhealthy (and fail what is open) if the engine failed or stopped moving."""
        for channel_id in self._channels.expire():
            self._log.warning("channel_expired", channel=channel_id, reason="its router was not heard from")
        if self._life.state not in (ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.STARTING):
            return
        engine = self._backend.health()
        if engine.error is not None:
            self._engine_failed(engine.error)
        elif engine.stuck_for > self._step_timeout_s:
            self._wedged(f"its engine step has not returned for {engine.stuck_for:.0f}s "
                         f"(limit {self._step_timeout_s:g}s, ATOMR_STEP_TIMEOUT_S)", engine.stuck_for)
        elif engine.in_call_for > self._call_timeout_s:
            self._wedged(f"its engine call (loading a LoRA adapter) has not returned for {engine.in_call_for:.0f}s "
                         f"(limit {self._call_timeout_s:g}s, ATOMR_ENGINE_CALL_TIMEOUT_S)", engine.in_call_for)
        elif not engine.alive:
            self._engine_failed(EngineError(f"{self!r}: its step loop is not running"))

    def _wedged(self, why: str, stuck_s: float) -> None:
        wedged = EngineError(f"{self!r} is wedged: {why}")
        if self._life.to(ReplicaState.UNHEALTHY, "wedged", wedged):
            self._log.error("engine_wedged", stuck_s=round(stuck_s, 1), open=self._open_requests())
            self._channels.close_all(str(wedged))
            self._backend.fail_open(wedged)

    def _load(self) -> tuple[int, int, EngineStats]:
        """Requests open, those waiting, and the engine's stats, from one read of its metrics.
        Waiting as the engine counts it, queued and not scheduled, where its metrics say: a whole
        answer (stream: false) has no output before its end, so "no token yet" counts it waiting
        until it is done."""
        no_token_yet = self._backend.open_requests()[1]
        engine = self._backend.stats()
        return self._open_requests(), no_token_yet if engine.waiting is None else engine.waiting, engine

    def _publish_gauges(self) -> None:
        in_flight, waiting, engine = self._load()
        self._metrics.set_load(in_flight, waiting, engine.kv_cache_usage)
        self._metrics.set_state(self._life.state.value)

    def _start_tasks(self) -> None:
        if self._tasks:
            return
        me = weakref.ref(self)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(run_every(me, WATCHDOG_PERIOD_S, VllmReplica._check)))
        if self._metrics.enabled:
            self._tasks.append(loop.create_task(run_every(me, GAUGE_PERIOD_S, VllmReplica._publish_gauges)))

    async def _wait_ready(self, timeout: float | None) -> None:
        self._start_tasks()
        try:
            facts = await self._backend.wait_started(timeout)
        except AtomrError as exc:
            # A start that failed (the engine, or its serving layer) is final; a timeout is not.
            if isinstance(exc, EngineStartFailed) and self._life.to(ReplicaState.UNHEALTHY, "failed to start", exc):
                self._log.error("replica_start_failed", error=str(exc))
            raise
        # The spec's adapters, before it first serves; not again when a restarted manager re-adopts
        # it (it would go back to those it started with: health checks keep it to the current ones).
        if self._deployment.lora is not None and self._life.state is ReplicaState.STARTING:
            await asyncio.gather(*self._adapters.sync(self._deployment.lora.adapters))
        if self._life.to(ReplicaState.READY):
            self._facts = dataclasses.asdict(facts)
            self._log.info("replica_ready", max_model_len=facts.max_model_len, start_s=round(self._uptime(), 1))
            tune_serving_process()  # started: what exists now lives as long as the process

    def _uptime(self) -> float:
        return time.time() - self._life.started_at

    def _admit(self) -> None:
        """Raise unless this replica takes new requests (the router retries ReplicaUnavailable)."""
        error = self._life.admission_error()
        if error is not None:
            raise error

    # -- the manager's calls ----------------------------------------------------------------

    async def ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Resolve once the engine and its serving layer have started; raise ``EngineError``
        (``EngineStartFailed``) if either failed or timed out."""
        await self._wait_ready(timeout)
        return {"replica_id": self._replica_id, "device": self._device, "model": self._deployment.model,
                "state": self._life.state.value, **self._facts, **_placement()}

    async def health(self, adapters: dict[str, str] | None = None, retry: int = 0) -> ReplicaHealth:
        """The replica's health report; raises ``EngineError`` once it is unhealthy.

        ``adapters``: the LoRA adapters the deployment has now (name -> directory); the replica
        loads and unloads to match, while it serves, and reports each one's state. ``retry``: a
        count other than the last one heard tries those that failed again at once."""
        self._check()
        if self._life.state is ReplicaState.UNHEALTHY:
            raise EngineError(f"{self!r} is unhealthy: {self._life.error}")
        if adapters is not None and self._deployment.lora is not None and self._life.state is ReplicaState.READY:
            self._adapters.sync(adapters, retry)
        in_flight, waiting, _ = self._load()
        return dataclasses.replace(self._life.report(in_flight, waiting), adapters=dict(self._adapters.states))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the engine's cached prefixes (the control plane does it for every replica of a
        deployment: ``atomr reset-cache``); False when running requests held cached blocks."""
        self._check()
        reset = await self._backend.reset_prefix_cache(reset_running_requests)
        self._log.info("prefix_cache_reset", reset=reset, reset_running_requests=reset_running_requests)
        return reset

    async def stats(self) -> ReplicaStats:
        in_flight, waiting, engine = self._load()
        return self._stats.snapshot(
            in_flight=in_flight, waiting=waiting, phase=self._life.progress, uptime_s=self._uptime(),
            kv_cache_usage=engine.kv_cache_usage, steps=engine.steps, engine_unfinished=engine.unfinished,
        )

    async def in_flight(self) -> int:
        return self._open_requests()

    async def drain(self, timeout: float = 30.0) -> int:
        """Stop taking requests and wait up to ``timeout`` s for in-flight ones. Returns how many remain."""
        self._life.to(ReplicaState.DRAINING)
        self._log.info("replica_draining", in_flight=self._open_requests())
        deadline = time.monotonic() + timeout
        while self._open_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._open_requests()

    async def shutdown(self) -> None:
        """Fail what is still open, stop the engine and free it."""
        self._life.to(ReplicaState.STOPPED)
        await self._backend.shutdown(ReplicaUnavailable(f"{self!r} was shut down"))
        if self._metrics.enabled:
            self._publish_gauges()
        self._log.info("replica_stopped")

    # -- the routers' calls -----------------------------------------------------------------

    async def tokenizer_files(self) -> dict[str, str]:
        """The model's tokenizer and chat template, for a router that hashes prompts as the
        engine caches them (routing.policy kv_events): ``tokenizer.json``,
        ``tokenizer_config.json`` and ``chat_template.jinja`` where the model has them; only
        ``untokenizable`` (why) where the engine tokenizes with another tokenizer."""
        return await asyncio.to_thread(tokenizer_files, self._deployment)

    async def open_many(self, channel_id: str, requests: list[OpenRequest]) -> list[int | AtomrError]:
        """Admit each request and run it into the caller's channel, in order, in one call: a
        router sends every request it opened here in one turn of its event loop together (a
        Ray call costs ~0.6 ms of CPU in a burst). Returns, per request, the requests now open
        here, or the error that refused it: ``ReplicaBusy`` at its ``limit`` (the routing
        table's ``serving.max_concurrent``; else this replica's spec), counted over every
        router; ``ReplicaUnavailable`` when draining or stopped."""
        results: list[int | AtomrError] = []
        channel = self._channels.get(channel_id)
        for request in requests:
            try:
                self._admit()
                limit = request.limit or self._deployment.serving.max_concurrent
                results.append(self._channels.open(channel, request, self._serve, limit, repr(self),
                                                   self._backend.background_requests()))
            except AtomrError as exc:
                results.append(exc)
        return results

    async def _serve(
        self, request: HttpRequest, put: Callable[[HttpHead | bytes], None], tokens: Any, resume: list[int] | None,
        prefilled: Callable[[], None] | None = None,
    ) -> None:
        if self._life.state is not ReplicaState.READY:
            await self._wait_ready(None)
            self._admit()
        await self._backend.serve(request, put, tokens, resume, prefilled)

    async def channel(self, channel_id: str) -> AsyncIterator[Batch]:
        """The output of every request opened on ``channel_id``, in batches. Call as a Ray
        streaming generator, once per router; closing it cancels that router's requests."""
        async for batch in self._channels.stream(channel_id):
            yield batch

    async def cancel(self, channel_id: str, request_ids: list[str]) -> None:
        """The router's consumers left: abort these requests."""
        self._channels.cancel(channel_id, request_ids)

    async def keepalive(self, channel_id: str) -> None:
        """The router of ``channel_id`` is alive (replica/channel.py: a channel is a lease)."""
        self._channels.get(channel_id)

    async def http(self, request: HttpRequest) -> AsyncIterator[HttpHead | bytes]:
        """One OpenAI API request: its head, then its body as sent (SSE events while
        streaming), pieces the caller had not taken joined. Call as a Ray streaming generator."""
        self._admit()
        pending: MergingBuffer[HttpHead | bytes] = MergingBuffer(join_bytes)

        async def run() -> None:
            try:
                await self._serve(request, pending.put, None, None)
            except Exception as exc:  # noqa: BLE001 - the caller raises it after what came before
                pending.end(exc)
                return
            pending.end()

        runner = asyncio.get_running_loop().create_task(run())
        try:
            async for item in pending:
                yield item
        finally:
            runner.cancel()


def _placement() -> dict[str, Any]:
    """Node and GPU ids as Ray sees them (empty outside a Ray worker)."""
    try:
        import ray

        if not ray.is_initialized():
            return {}
        return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
    except Exception:  # noqa: BLE001 - placement is informational
        return {}


def replica_actor_class() -> Any:
    """``VllmReplica`` as a Ray actor class (async, generous concurrency)."""
    import ray

    return ray.remote(max_concurrency=10_000, max_restarts=0)(VllmReplica)


def tokenizer_files(deployment: Deployment) -> dict[str, str]:
    from atomr_infer.engine.vllm.kv_events import tokenizer_override
    from atomr_infer.models.resolve import resolve_for

    override = tokenizer_override(deployment)
    if override is not None:  # not the model folder's: a router cannot tokenize as the replica does
        return {"untokenizable": f"{override} is set"}
    path = resolve_for(deployment).path
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    files = {name: (path / name).read_text() for name in names if (path / name).is_file()}
    # What the replica's server renders chats with instead of the model's own (a file or inline
    # text, as vLLM loads it), and its default template arguments: the router renders as it does.
    openai = deployment.serving.openai
    if openai.chat_template is not None:  # (checked by the replica before its engine loaded)
        files["chat_template.jinja"] = _template_text(openai.chat_template)
    if isinstance(kwargs := openai.server_args.get("default_chat_template_kwargs"), dict):
        files["default_chat_template_kwargs.json"] = json.dumps(kwargs)
    return files


def _template_text(template: str) -> str:
    """A chat template as vLLM loads it: a file's text, or the string itself (an inline template
    is no path: as a name it may be too long for the OS, which vLLM takes as inline too)."""
    try:
        return Path(template).read_text() if Path(template).is_file() else template
    except OSError:
        return template
