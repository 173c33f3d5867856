"""Replica records and the small wrapper interface every Ray call goes through.

The reconciler only talks to ``ReplicaLauncher`` / ``ReplicaHandle``; ``control/ray_replicas``
implements them with Ray, and the unit tests with fakes, so the reconcile logic runs without
Ray (Ray Serve's ``ActorReplicaWrapper`` / ``MockReplicaActorWrapper`` pattern). Every method
returns at once: the reconciler polls, it never blocks on a slow replica.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from atomr_infer.spec import Deployment
from atomr_infer.status import ADAPTER_ROUTED, ReplicaState, ReplicaStatus, adapter_failure


@dataclass(frozen=True)
class Poll:
    """Outcome of a non-blocking check: still pending, ok, or failed with a reason."""

    done: bool
    ok: bool = True
    reason: str = ""
    # A start failure that will happen again with the same spec (the engine raised while
    # starting), as opposed to a transient one (the actor died, a node went away).
    recurring: bool = False

    @classmethod
    def pending(cls) -> Poll:
        return cls(False)

    @classmethod
    def success(cls) -> Poll:
        return cls(True)

    @classmethod
    def failed(cls, reason: str, recurring: bool = False) -> Poll:
        return cls(True, False, reason, recurring)


class ReplicaHandle(Protocol):
    actor_name: str

    def placement(self) -> dict[str, Any]:
        """actor_id, node_id, gpu_ids — whatever is known so far."""

    def poll_ready(self) -> Poll: ...

    def poll_health(self, adapters: dict[str, str] | None = None, retry: int = 0) -> Poll:
        """Start a health check if none is running (telling the replica the LoRA ``adapters``
        it should serve; a ``retry`` count other than the last it heard: try the failed ones again
        at once); report the last finished one."""

    def adapters(self) -> dict[str, str]:
        """Each LoRA adapter's state on the replica (loading, loaded, reloading, failed: why), as
        of the last health check."""

    def adapters_asked(self, retry: int = 0) -> dict[str, str] | None:
        """The adapters (name -> source) the last answered health check asked the replica to
        serve: its ``adapters()`` are the answer to those (None before any answer, or when that
        check sent another ``retry`` count: the answer predates the retry)."""

    def in_flight(self) -> int:
        """Last known number of requests in flight (refreshed with health checks)."""

    def answered_draining(self) -> bool:
        """It answered ready() draining: told to drain by a manager that then died."""

    def begin_drain(self, timeout_s: float) -> None: ...

    def poll_drained(self) -> Poll: ...

    def stop(self) -> None:
        """Shut down the engine and kill the actor (no wait)."""

    def actor(self) -> Any:
        """The object requests are sent to (a Ray actor handle)."""

    def waiting_for(self) -> str | None:
        """While it starts: why it has not, where that is known (Ray has not placed it); else None."""


class ReplicaLauncher(Protocol):
    def start(self, deployment: Deployment, replica_id: str, peer_nodes: Sequence[str] = ()) -> ReplicaHandle:
        """Create the replica; ``peer_nodes``: the nodes of the deployment's other live replicas
        (one entry per replica), for ``placement``."""

    def adopt(self, deployment: str, replica_id: str) -> ReplicaHandle | None:
        """Re-attach to a live replica of the deployment named ``deployment`` by its name (after
        a manager restart); None if gone."""

    def replica_ids(self, deployment: str) -> list[str]:
        """The ids of every live replica of the deployment named ``deployment`` (one listing)."""


@dataclass
class ReplicaRecord:
    replica_id: str  # "r0", "r1", ... unique within the deployment
    runtime_key: str  # which spec it runs; a different key means "replace me"
    generation: int  # the deployment generation it was started for
    handle: ReplicaHandle
    state: ReplicaState = ReplicaState.STARTING
    reason: str = ""
    started_at: float = 0.0
    state_since: float = 0.0
    last_health_at: float = 0.0
    drain_deadline: float = 0.0
    made_room: bool = False  # a new replica Ray could not place, for which an old one was stopped
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        """Counts toward the replica set (not on its way out)."""
        return self.state.live

    @property
    def unheard(self) -> bool:
        """Adopted by a restarted manager and not heard ready yet: it may be serving (routers'
        cached tables list it), so it is neither stopped as a replica still starting nor passed over."""
        return self.state == ReplicaState.STARTING and bool(getattr(self.handle, "adopted", False))

    def status(self, adapters_wanted: Collection[str]) -> ReplicaStatus:
        """What ``atomr status`` shows of it: the LoRA adapters among ``adapters_wanted`` (one an
        apply removed is not listed while it unloads), and while it starts why it waits, where known."""
        handle = self.handle
        return ReplicaStatus(
            replica_id=self.replica_id,
            actor_name=handle.actor_name,
            state=self.state,
            generation=self.generation,
            reason=self.reason or (handle.waiting_for() if self.state == ReplicaState.STARTING else None) or None,
            in_flight=handle.in_flight(),
            started_at=self.started_at,
            adapters={n: state for n, state in handle.adapters().items() if n in adapters_wanted},
            **{k: tuple(v) if k == "gpu_ids" else v for k, v in handle.placement().items()},
        )


AdapterRoutes = tuple[frozenset[str], frozenset[str], tuple[tuple[str, str], ...]]


def adapter_routes(handle: ReplicaHandle, wanted: Mapping[str, str] | None = None, retry: int = 0) -> AdapterRoutes:
    """The LoRA adapters loaded on the replica (requests for one are routed only where it is),
    those of ``wanted`` (name -> source) it is still loading or has not reported yet (a request
    for one waits for it to load), and those it failed to load from the source wanted now, with
    why (a request for one fails at once when every replica failed it; one whose source an apply
    just changed waits for the replica to hear of it)."""
    wanted = wanted or {}
    states, asked = handle.adapters(), handle.adapters_asked(retry) or {}
    # Reloading from a new source: vLLM serves the old weights until the new ones are in.
    # Only the spec's: one an apply removed is not routed while the replica unloads it, nor on a
    # replica still on an older spec (mid-roll).
    loaded = frozenset(name for name, state in states.items() if state in ADAPTER_ROUTED and name in wanted)
    failed = {n: why for n, source in wanted.items()
              if (why := adapter_failure(states.get(n, ""))) is not None and asked.get(n) == source}
    return loaded, frozenset(n for n in wanted if n not in loaded and n not in failed), tuple(sorted(failed.items()))
