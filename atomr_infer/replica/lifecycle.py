"""A replica's life as a state machine: its states (``ReplicaState``, the same the manager
reports), the transitions allowed between them, in one place, and the typed health report
that the manager, the routers' view in ``atomr status`` and the metrics all read.

    STARTING ──► READY ──► DRAINING ──► STOPPED
        │          │           │           ▲
        └──────────┴───────────┴─► UNHEALTHY ┘      (any state ──► STOPPED on shutdown)

UNHEALTHY is final but for STOPPED: a replica whose engine failed, was wedged or never
started is replaced by the manager, never revived. Start progress is free text beside the
state (``progress``), not a state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from atomr_infer.errors import AtomrError, ReplicaUnavailable
from atomr_infer.status import ReplicaState

S = ReplicaState
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    S.STARTING: frozenset({S.READY, S.DRAINING, S.UNHEALTHY, S.STOPPED}),
    S.READY: frozenset({S.DRAINING, S.UNHEALTHY, S.STOPPED}),
    S.DRAINING: frozenset({S.UNHEALTHY, S.STOPPED}),
    S.UNHEALTHY: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class ReplicaHealth:
    """A replica's answer to ``health()`` (and the state its gauges show)."""

    state: ReplicaState
    progress: str  # a start step while starting; else the state, or why it failed
    in_flight: int
    waiting: int  # admitted, no output yet
    uptime_s: float
    error: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> loading | loaded | failed: why


class Lifecycle:
    def __init__(self, name: str) -> None:
        self._name = name
        self.state = S.STARTING
        self.progress = "starting"
        self.error: BaseException | None = None  # why it is UNHEALTHY
        self.started_at = time.time()

    def to(self, state: ReplicaState, progress: str | None = None, error: BaseException | None = None) -> bool:
        """Move to ``state`` if the machine allows it from here; False (nothing changes) if
        not: a late engine failure does not revive a stopped replica, a drain does not hide
        a failure."""
        if state is self.state or state not in TRANSITIONS[self.state]:
            return False
        self.state = state
        self.progress = progress or state.value
        if error is not None:
            self.error = error
        return True

    def admission_error(self) -> AtomrError | None:
        """Why this replica takes no new request (the router retries ``ReplicaUnavailable``
        elsewhere), or None."""
        if self.state in (S.DRAINING, S.STOPPED):
            return ReplicaUnavailable(f"{self._name} is {self.state.value}")
        if self.state is S.UNHEALTHY:  # its engine died or wedged: another replica may serve the request
            return ReplicaUnavailable(f"{self._name} is unhealthy: {self.error!r}")
        return None

    def report(self, in_flight: int, waiting: int) -> ReplicaHealth:
        error = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return ReplicaHealth(self.state, self.progress, in_flight, waiting, time.time() - self.started_at, error)
