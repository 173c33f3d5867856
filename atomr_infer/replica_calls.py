"""Every call that routers and the control plane make to a replica actor, in one wrapper, and
the one translation of what such a call can raise.

``ReplicaCalls`` names the replica's methods with their wire types (wire.py); the Ray handle
(or a test's fake of it) is reached only here. ``replica_failure`` sorts an exception from any
of these calls into what the caller does about it:

- ``DEAD``: the actor is gone for good (it died, or was killed): exclude it, retry elsewhere;
- ``UNREACHABLE``: Ray cannot reach it now (it may come back), or its channel closed, or Ray
  lost the call or its output on the way (``ObjectLostError``: a batch held in the object store
  of a node that died; ``RaySystemError``);
- ``BUSY``: at its ``max_concurrent`` (``ReplicaBusy``): route again, it counts as full;
- ``UNAVAILABLE``: draining or stopped (``ReplicaUnavailable``): never picked again;
- ``FAILED``: the request itself failed there (atomr's own error, or anything else as
  ``EngineError``), with the cause a caller can show in one line.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any

from atomr_infer.errors import AtomrError, EngineError, ReplicaBusy, ReplicaUnavailable, one_line, unwrap
from atomr_infer.wire import OpenRequest


class Failure(enum.Enum):
    DEAD = "dead"
    UNREACHABLE = "unreachable"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"
    FAILED = "failed"


@dataclass(frozen=True)
class ReplicaFailure:
    kind: Failure
    cause: BaseException  # unwrapped from Ray's task error; atomr's own where it is one

    @property
    def reason(self) -> str:
        """One line for logs and ``atomr status``."""
        # Ray's texts end with a "For further information ..." line: the reason is before it.
        lines = [ln for ln in str(self.cause).strip().splitlines() if not ln.strip().startswith("For further")]
        text = one_line(Exception("\n".join(lines))) if lines else type(self.cause).__name__
        return text if isinstance(self.cause, AtomrError) or not lines else f"{type(self.cause).__name__}: {text}"


def replica_failure(exc: BaseException) -> ReplicaFailure:
    """What a call to a replica raised, sorted (see the module's docstring)."""
    from ray.exceptions import ActorUnavailableError, NodeDiedError, ObjectLostError, RayActorError, RaySystemError

    if isinstance(exc, ActorUnavailableError | ConnectionError):  # a subclass of RayActorError: first
        return ReplicaFailure(Failure.UNREACHABLE, exc)
    if isinstance(exc, RayActorError | NodeDiedError):  # ActorDiedError among them
        return ReplicaFailure(Failure.DEAD, exc)
    # Ray lost the call or its output on the way. Not every error of Ray's: one of the caller's
    # own side (its object store full, its disk, a cancel) says nothing of the replica, and an
    # exclusion lasts until the table changes: it stays a failure of this request (FAILED).
    if isinstance(exc, ObjectLostError | RaySystemError):
        return ReplicaFailure(Failure.UNREACHABLE, exc)
    cause = unwrap(exc)
    if isinstance(cause, ReplicaBusy):
        return ReplicaFailure(Failure.BUSY, cause)
    if isinstance(cause, ReplicaUnavailable):
        return ReplicaFailure(Failure.UNAVAILABLE, cause)
    if isinstance(cause, AtomrError):
        return ReplicaFailure(Failure.FAILED, cause)
    return ReplicaFailure(Failure.FAILED, EngineError(f"{type(cause).__name__}: {cause}"))


class ReplicaCalls:
    """A replica actor's methods, typed. Each returns what Ray's ``.remote`` returns (an object
    ref, or for streams an object-ref generator): the caller awaits or polls it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    # -- the routers' ------------------------------------------------------------------------

    def open_many(self, channel_id: str, requests: list[OpenRequest]) -> Any:
        return self.actor.open_many.remote(channel_id, requests)

    def channel(self, channel_id: str) -> Any:
        return self.actor.channel.remote(channel_id)

    def cancel(self, channel_id: str, request_ids: list[str]) -> Any:
        return self.actor.cancel.remote(channel_id, request_ids)

    def keepalive(self, channel_id: str) -> Any:
        return self.actor.keepalive.remote(channel_id)

    # -- the control plane's -----------------------------------------------------------------

    def ready(self, timeout_s: float | None = None) -> Any:
        return self.actor.ready.remote(timeout_s)

    def health(self, adapters: dict[str, str] | None = None, retry: int = 0) -> Any:
        # ``retry`` only when asked, and only where taken: a replica a restarted manager adopts may
        # run the atomr before it (upgraded in place), whose health takes ``adapters`` alone; Ray
        # refuses the call (TypeError) and the check failed and stopped every adopted replica. Such
        # a replica retries a failed adapter on its own backoff.
        if retry:
            with contextlib.suppress(TypeError):
                return self.actor.health.remote(adapters, retry)
        return self.actor.health.remote(adapters)

    def stats(self) -> Any:
        return self.actor.stats.remote()

    def drain(self, timeout_s: float) -> Any:
        return self.actor.drain.remote(timeout_s)

    def shutdown(self) -> Any:
        return self.actor.shutdown.remote()
