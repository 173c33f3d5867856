"""Work started from inside a request that must not end with it.

Ray runs an actor method (an ingress request, say) in a task whose context carries its
cancellation: an asyncio task or callback created from there inherits that context, and Ray
cancels it with the request (a client hanging up). What serves many requests (a channel's
reader and lease renewal, the batched opens, the routing table's long poll) or must outlive
the request (the cancel that tells the replica its consumer left) is started from a fresh,
empty context instead. The one place that says so.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def outside_request(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` run in an empty context: tasks and callbacks it creates belong
    to no request (``loop.create_task``, ``loop.call_soon``, an actor method's ``.remote``)."""
    return contextvars.Context().run(fn, *args, **kwargs)
