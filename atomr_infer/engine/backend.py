"""The engine interface: what a replica, and through it the rest of atomr, sees of an engine.

At the level of vLLM's async client (``EngineClient``), not of its step function: start, serve
an OpenAI request, submit a request and stream its outputs, abort, health and progress,
stats, load/unload a LoRA adapter, and, for a spec, check its engine settings and say what it
needs. A backend implements it; ``VllmBackend`` (engine/vllm/backend.py) owns every vLLM
specific behind it: engine arguments, the step loop, coalescing, the engine client vLLM's
OpenAI serving layer runs on, and that layer's app. The emulated engine of the benchmarks is
the same backend over a timed core. Nothing outside a backend imports its engine.

Adding an engine means adding a package under ``atomr_infer/engine/`` with a class that
satisfies ``EngineBackend`` and naming it in ``backend_class`` (docs/architecture.md).

The replica (replica/actor.py) drives a backend from its event loop: ``start`` once, then
``wait_started``; ``serve`` per request, with ``put`` receiving the response head and body
pieces in order; ``health`` from its watchdog; ``shutdown`` once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from atomr_infer.spec import Deployment
from atomr_infer.wire import HttpHead, HttpRequest

Put = Callable[[HttpHead | bytes], None]
# Token ids a request generated since the last call (a resumable request asked for them).
TokenSink = Callable[[list[int]], None]
Prefilled = Callable[[], None]  # told when the request's prompt is computed (serve says when)

# An engine call between two steps (loading a LoRA adapter: read from a slow disk or share, it may
# take minutes) runs far longer than a step may: the replica waits for it, and its watchdog
# bounds it, by this instead of ATOMR_STEP_TIMEOUT_S. ATOMR_ENGINE_CALL_TIMEOUT_S overrides it.
DEFAULT_ENGINE_CALL_TIMEOUT_S = 300.0


def engine_call_timeout_s() -> float:
    return float(os.environ.get("ATOMR_ENGINE_CALL_TIMEOUT_S", DEFAULT_ENGINE_CALL_TIMEOUT_S))


@dataclass(frozen=True)
class EngineFacts:
    """What a started engine settled: reported by ``ready()`` and shown by ``atomr status``."""

    max_model_len: int | None = None
    dtype: str | None = None
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    # The routes its server has for this model, as "METHOD /path" (an embedding model has no chat).
    routes: tuple[str, ...] = ()
    # Where it publishes its KV-cache events: {"endpoint", "replay_endpoint", "block_size"}.
    kv_events: dict[str, Any] | None = None
    # vLLM's serving layer parses every chat answer of this model (Harmony: gpt-oss), whatever the
    # spec's parsers: a stream's text is no longer a function of its token ids alone mid-way.
    parses_output: bool = False


@dataclass(frozen=True)
class EngineHealth:
    """The engine's own word on itself: ``error`` set once it failed for good; ``stuck_for`` is
    how long its current step has run (a wedged engine never returns from one); ``in_call_for``,
    how long a call between steps (loading a LoRA adapter) has run, bounded on its own."""

    error: BaseException | None = None
    stuck_for: float = 0.0
    in_call_for: float = 0.0
    alive: bool = True  # the thread or process that drives it still runs


@dataclass(frozen=True)
class EngineStats:
    kv_cache_usage: float | None = None
    waiting: int | None = None  # queued in the engine, not scheduled yet, where its metrics say
    steps: int = 0
    unfinished: int | None = None  # requests the engine itself still holds


@dataclass(frozen=True)
class BackendContext:
    """What a replica hands its backend: where to report start progress, and the replica's
    per-request accounting (its stats collector and metrics, both engine-neutral)."""

    deployment: Deployment
    name: str  # the replica's, for logs and threads
    progress: Callable[[str], None]
    stats: Any  # engine/stats.py StatsCollector
    metrics: Any  # metrics.py ReplicaMetrics
    log: Any


class EngineBackend(Protocol):
    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Start the engine in the background; ``on_failure`` is called once if it fails (to
        start, or later: every open request has then been failed with it)."""

    async def wait_started(self, timeout: float | None) -> EngineFacts:
        """Return once the engine and its serving layer run; raise its start error."""

    async def serve(
        self, request: HttpRequest, put: Put, tokens: TokenSink | None = None, resume: list[int] | None = None,
        prefilled: Prefilled | None = None,
    ) -> None:
        """Answer one OpenAI API request with the engine's own serving layer: ``put`` gets the
        head, then the body pieces; ``tokens`` (if given) the token ids it generates. With
        ``resume``, the request's answer continues after those token ids (generated by a
        replica that died): the answer and its usage are the whole answer's. ``prefilled`` (if
        given) is called when its prompt is computed, where the answer is not streamed (a
        streamed one's first body bytes say so; an engine that cannot tell leaves it to the
        end; a request of several prompts may call it for each). Returns at the response's end;
        cancelled, it aborts the request in the engine."""

    def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """Submit a request and stream its outputs (the engine's own output type); closing the
        iterator early aborts it. The level vLLM's serving layer, benchmarks and tests use."""

    def abort(self, request_ids: list[str]) -> None: ...

    def health(self) -> EngineHealth: ...

    def stats(self) -> EngineStats: ...

    def open_requests(self) -> tuple[int, int]:
        """Requests open in the engine, and of those, how many have no output yet."""

    def background_requests(self) -> int:
        """Work running on after its request ended (background responses), which takes a place
        in ``serving.max_concurrent`` as its request did."""

    def fail_open(self, error: BaseException) -> None:
        """Fail every open request with ``error`` (the replica found the engine wedged)."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the engine's cached prefixes (vLLM's ``/reset_prefix_cache``); False when
        running requests hold cached blocks and ``reset_running_requests`` is not set (with it,
        they are preempted and recomputed)."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter so that requests can name it."""

    async def unload_adapter(self, name: str) -> None: ...

    async def shutdown(self, error: BaseException) -> None:
        """Fail what is open with ``error``, stop the engine and free its memory."""


class BackendClass(Protocol):
    """The class side: checks that need the engine's package, run where importing it is
    cheap (the ``atomr`` CLI before it applies, a replica before its engine starts), never in
    the manager's long-lived process."""

    def __call__(self, context: BackendContext) -> EngineBackend: ...

    def validate(self, deployment: Deployment) -> None:
        """Raise ``SpecError`` for engine settings the engine does not have."""


def backend_class(deployment: Deployment) -> BackendClass:
    """The backend that serves ``deployment`` (vLLM for every spec today; its emulated engine
    where ``ATOMR_EMULATED_STEP_MS`` is set, engine/device.py)."""
    from atomr_infer.engine.device import emulated_step_s

    if emulated_step_s() is not None:
        from atomr_infer.engine.vllm.emulated_backend import EmulatedVllmBackend

        return EmulatedVllmBackend
    from atomr_infer.engine.vllm.backend import VllmBackend

    return VllmBackend
