"""The one thread that drives a replica's engine.

The thread first builds the engine (``engine_factory``), so one thread creates and drives it.
Each turn: take every queued submission and abort, call ``engine.step()`` once, and hand the
outputs of that step to ``on_outputs`` in one call. When the engine has nothing to do the
thread blocks on an event; it never spins or sleep-polls. If the engine raises, ``on_error``
receives the exception once (also when building the engine failed) and the loop ends:
the replica fails every open stream and reports itself unhealthy.

Never call ``step()`` per request: one step advances every running request, so a
per-request poller would drop the outputs of all the others.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Engine(Protocol):
    """What the loop uses of vLLM's ``LLMEngine`` (the emulated engine and tests' scripted ones
    are ``LLMEngine``s or have the same methods)."""

    def add_request(self, request_id: str, prompt: Any, params: Any, **options: Any) -> Any: ...

    def step(self) -> list[Any]: ...

    def abort_request(self, request_ids: Sequence[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Any  # an EngineCoreRequest, processed on the event loop
    params: Any
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Call:
    """Run ``fn(engine)`` between two steps (the engine is this thread's alone); its result or
    error goes to ``future``."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future[Any]

EngineFactory = Callable[[], Engine]
OnReady = Callable[[Engine], None]
OnOutputs = Callable[[list[Any]], None]
OnError = Callable[[BaseException], None]
OnRejected = Callable[[str, BaseException], None]
OnStep = Callable[[float], None]
AfterStep = Callable[[Engine], None]


_IDLE_STEP_S = 0.001  # a step this short computed nothing


class StepLoop:
    def __init__(
        self,
        engine_factory: EngineFactory,
        on_ready: OnReady,
        on_outputs: OnOutputs,
        on_error: OnError,
        on_rejected: OnRejected,
        name: str = "atomr-step-loop",
        on_step: OnStep | None = None,
        after_step: AfterStep | None = None,
    ) -> None:
        self._engine_factory, self._on_ready = engine_factory, on_ready
        self._on_step = on_step  # receives each step's duration in seconds (metrics)
        self._after_step = after_step  # reads the engine in this thread after each step (prefill_watch.py)
        self._engine: Engine | None = None
        self._on_outputs, self._on_error, self._on_rejected = on_outputs, on_error, on_rejected
        # deque append/popleft are atomic; the event wakes the loop.
        self._inbox: collections.deque[_Add | _Abort | _Call] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        # Set while the thread is in a turn (taking submissions, stepping, handing outputs
        # over); None while it waits for work. A turn that never ends is a wedged engine.
        self.turn_started_at: float | None = None
        # Set while an engine call (``call``) runs instead: loading a LoRA adapter may read it from
        # a slow disk for far longer than any step, so it is bounded on its own, not as a turn.
        self.call_started_at: float | None = None
        self.last_step_at = time.monotonic()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: Any, params: Any, **options: Any) -> None:
        """Add a request at the next turn: ``engine.add_request(request_id, prompt, params, **options)``."""
        self._inbox.append(_Add(request_id, prompt, params, options))
        self._wake.set()

    def abort(self, request_ids: Sequence[str]) -> None:
        self._inbox.append(_Abort(list(request_ids)))
        self._wake.set()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """``fn(engine)`` run by the loop's thread before its next step (loading a LoRA adapter, an
        operator's action: resetting the prefix cache); the future has its result. Its time shows
        in ``in_call_for``, not ``stuck_for``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.append(_Call(fn, future))
        self._wake.set()
        return future

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stuck_for(self) -> float:
        """Seconds the current turn has been running (0 while the loop waits for work).

        Progress, not an answer to a call: a step that never returns, an ``add_request`` that
        hangs, or outputs that cannot be handed over all show here while the thread is alive."""
        started = self.turn_started_at
        return 0.0 if started is None else time.monotonic() - started

    def in_call_for(self) -> float:
        """Seconds the engine call running now (``call``) has run; 0 when none. Not counted in
        ``stuck_for``: the turn's clock starts again once the call returns."""
        started = self.call_started_at
        return 0.0 if started is None else time.monotonic() - started

    def _drain_inbox(self, engine: Engine) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Add):
                try:
                    engine.add_request(item.request_id, item.prompt, item.params, **item.options)
                except Exception as exc:  # a bad request fails alone
                    # vLLM's LLMEngine registers it before handing it to the core, which may be
                    # what raised: left there, it never finished and the loop stepped for good.
                    with contextlib.suppress(Exception):
                        _abort(engine, [item.request_id])
                    self._on_rejected(item.request_id, exc)
            elif isinstance(item, _Call):
                # A caller that stopped waiting (a timeout, a client gone) cancelled it: skip it.
                # Once running it cannot be cancelled, so its result always lands (a cancel
                # landing on a running call made set_result raise here and ended the loop).
                if not item.future.set_running_or_notify_cancel():
                    continue
                self.turn_started_at, self.call_started_at = None, time.monotonic()
                try:
                    item.future.set_result(item.fn(engine))
                except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine steps on
                    item.future.set_exception(exc)
                finally:
                    self.turn_started_at, self.call_started_at = time.monotonic(), None
            else:
                _abort(engine, item.request_ids)

    def _run(self) -> None:
        try:
            # Built here so one thread creates and drives the engine for its whole life.
            engine = self._engine = self._engine_factory()
            self._on_ready(engine)
            # The core in this thread (vLLM's InprocClient holds it): a step that finds nothing
            # to run returns at once. Over a core process, step() waits for the core instead.
            in_process = hasattr(getattr(engine, "engine_core", None), "engine_core")
            while not self._stop:
                # Clear before draining: a submit that lands after the drain sets it again,
                # so the wait below returns at once instead of missing it.
                self._wake.clear()
                self.turn_started_at = time.monotonic()
                self._drain_inbox(engine)
                if engine.has_unfinished_requests():
                    started = time.monotonic()
                    outputs = engine.step()
                    self.steps += 1
                    self.last_step_at = time.monotonic()
                    if self._on_step is not None:
                        self._on_step(self.last_step_at - started)
                    if outputs:
                        self._on_outputs(outputs)
                    elif in_process and self.last_step_at - started < _IDLE_STEP_S:
                        # Nothing ran (a request waits for its grammar, compiled in another
                        # thread): yield the GIL a moment, as vLLM's core process does, rather
                        # than spin on step() against that thread and the actor's event loop.
                        time.sleep(_IDLE_STEP_S)
                    if self._after_step is not None:
                        self._after_step(engine)
                else:
                    self.turn_started_at = None
                    self._wake.wait()
        except BaseException as exc:  # noqa: BLE001 - the loop must report every failure
            self.error = exc
            self._on_error(exc)
        finally:
            self.turn_started_at = self.call_started_at = None
            self._fail_calls(RuntimeError("the engine's step loop stopped"))
            if self._engine is not None:
                close_engine(self._engine)

    def _fail_calls(self, error: BaseException) -> None:
        """Answer the calls still queued: their callers would wait out their timeouts."""
        for item in list(self._inbox):
            if isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)


def close_engine(engine: Engine) -> None:
    """Free the engine's processes and memory (vLLM: its engine-core client)."""
    shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(Exception):  # best effort on the way out
            shutdown()


def _abort(engine: Engine, request_ids: list[str]) -> None:
    """Abort requests by the ids they were added with, and a parallel-sampling (``n`` > 1)
    request's parent by its internal id, as ``AsyncLLM`` does: vLLM drops the parent only so.
    Aborted by its external id alone, it stayed in the output processor for good, with the
    choices that had finished (~100 KB per aborted ``n=4`` answer of 1,000 tokens)."""
    parents = getattr(getattr(engine, "output_processor", None), "parent_requests", None)
    if parents:
        ids = set(request_ids)
        internal = [parent.request_id for parent in parents.values() if parent.external_req_id in ids]
        if internal:
            engine.abort_request(internal, internal=True)  # type: ignore[call-arg]
    engine.abort_request(request_ids)
