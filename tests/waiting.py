"""The one way tests wait for something to happen: poll a predicate until it holds, then go on
at once; fail naming what did not happen (never sleep a fixed time, then assert)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _polls(predicate: Callable[[], T], timeout_s: float, what: str) -> Iterator[T]:
    """Yields the predicate's value while it is falsy; returns once it is truthy (the value
    is then the generator's return value); raises ``AssertionError`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g}s (last: {value!r})")
        yield value
    return value


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.05,
               what: str = "the condition") -> T:
    """The predicate's first truthy value; ``AssertionError`` if none within ``timeout_s``."""
    polls = _polls(predicate, timeout_s, what)
    try:
        while True:
            next(polls)
            time.sleep(interval_s)
    except StopIteration as done:
        return done.value


async def await_until(predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.02,
                      what: str = "the condition") -> T:
    """``wait_until`` on an event loop: the loop runs while it waits."""
    polls = _polls(predicate, timeout_s, what)
    try:
        while True:
            next(polls)
            await asyncio.sleep(interval_s)
    except StopIteration as done:
        return done.value
