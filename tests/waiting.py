"""The one way tests wait for something to happen: poll a predicate until it holds, then go on
at once; fail naming what did not happen (never sleep a fixed time, then assert)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.05,
               what: str = "the condition") -> T:
    """The predicate's first truthy value; ``AssertionError`` if none within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g}s (last: {value!r})")
        time.sleep(interval_s)


async def await_until(predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.02,
                      what: str = "the condition") -> T:
    """``wait_until`` on an event loop: the loop runs while it waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g}s (last: {value!r})")
        await asyncio.sleep(interval_s)
