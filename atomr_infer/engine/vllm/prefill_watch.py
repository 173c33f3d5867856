"""Telling a request's caller that its prompt is computed, when vLLM says nothing until the end.

A router (kv_events) counts a request's prompt as prefill waiting on its replica until the
request's first output. A streamed answer's first token comes out at once; a whole answer
(``stream: false``: vLLM's ``RequestOutputKind.FINAL_ONLY``) has no output before its last, so
without this its prompt would count as waiting until the whole answer is done. vLLM's output
processor knows sooner: ``request_states[id].is_prefilling`` turns False with the first token.

The step-loop thread owns the output processor, so it reads that flag after each step for the
requests watched here, and hands the ones done over to the replica's event loop, which calls
each caller's callback once. The engine knows a request by an id of its own (``LLMEngine``
appends random characters to ours when it adds it, in that thread): the watch keeps the
``EngineCoreRequest`` and reads its id there. Only whole answers whose caller asked
(``PREFILLED``) are watched: the step thread pays nothing otherwise.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from atomr_infer.log import get_logger

log = get_logger(__name__)

# Set per request by the backend's ``serve`` where its caller wants to hear when the prompt is
# computed; read by the engine client in the task vLLM's handler runs in (it copies the context).
PREFILLED: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "atomr_prefilled", default=None
)


class PrefillWatch:
    def __init__(self, hand_over: Callable[[Callable[[list[str]], None], list[str]], None]) -> None:
        self._hand_over = hand_over  # (fn, ids): fn(ids) run in the event loop
        # Our id -> (its request, the callback): the event loop's alone.
        self._callbacks: dict[str, tuple[Any, Callable[[], None]]] = {}
        # Our id -> the EngineCoreRequest, shared with the step thread: a dict's item assignment,
        # pop and copy (list(d.items())) each hold the GIL throughout.
        self._requests: dict[str, Any] = {}
        self._failed = False  # reading the engine failed once: watch nothing more

    def add(self, request_id: str, request: Any, callback: Callable[[], None]) -> None:
        """Watch ``request`` (submitted to the step loop as ``request_id``) until its prompt is computed."""
        if self._failed:
            return  # it counts until its first output, as without the watch
        self._callbacks[request_id] = (request, callback)
        self._requests[request_id] = request

    def forget(self, request_id: str) -> None:
        """Its stream ended (or its caller left): nothing more to tell."""
        self._requests.pop(request_id, None)
        self._callbacks.pop(request_id, None)

    def after_step(self, engine: Any) -> None:
        """In the step thread, after a step: hand over the watched requests now past prefill.
        One dict lookup per watched request (those still queued in the engine too), per step."""
        if not self._requests:
            return
        states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        if states is None:  # an engine without vLLM's output processor: they count until the end
            return
        done = []
        try:
            for request_id, request in list(self._requests.items()):
                state = states.get(request.request_id)  # the engine's id, once it added the request
                # None: not added yet (it is, at the next turn) or already gone (its end says so).
                if state is not None and not state.is_prefilling:
                    done.append((request_id, request))
                    self._requests.pop(request_id, None)
        except Exception as exc:  # noqa: BLE001 - a vLLM that changed: never stop the engine for this
            self._failed = True
            self._requests.clear()
            log.warning("prefill_watch_off", error=f"{type(exc).__name__}: {exc}")
        if done:
            self._hand_over(self._tell, done)

    def _tell(self, done: list[tuple[str, Any]]) -> None:
        for request_id, request in done:
            watched = self._callbacks.get(request_id)
            if watched is not None and watched[0] is request:  # not a later request with the same id
                del self._callbacks[request_id]
                watched[1]()
