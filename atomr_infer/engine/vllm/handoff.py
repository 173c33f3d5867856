"""Calls from the step-loop thread into the replica's event loop: each step's outputs, a
rejected request, the engine's failure.

Where the engine core steps in the step loop's thread (vLLM's in-process core: our CPU
default), outputs are handed over with one ``call_soon_threadsafe`` and the thread goes on to
the next step, which overlaps the loop's work on these. Where the core steps on its own (a GPU
core process, the emulated engine: engine/vllm/coalesce.py), the thread waits until the loop has
taken the outputs (``paced``): the steps the core finishes meanwhile are then taken as one, so
a loop that falls behind gets bigger deltas, not more of them, and its work per token stays
bounded. The wait is bounded, so a closed or stuck loop cannot hold the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

HANDOFF_WAIT_S = 1.0


class LoopHandoff:
    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None  # the actor's, once a method ran
        self.paced = False  # set once the engine is up: its core steps on its own

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` in the loop soon (nothing once the loop is closed)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def outputs(self, dispatch: Callable[[list[Any]], None], outputs: list[Any]) -> None:
        """``dispatch(outputs)`` in the loop; when ``paced``, return once it has run."""
        if not self.paced:
            self.call(dispatch, outputs)
            return
        taken = threading.Event()
        self.call(_run_then_set, dispatch, outputs, taken)
        taken.wait(HANDOFF_WAIT_S)


def _run_then_set(dispatch: Callable[[list[Any]], None], outputs: list[Any], taken: threading.Event) -> None:
    try:
        dispatch(outputs)
    finally:
        taken.set()
