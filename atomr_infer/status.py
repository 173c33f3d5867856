"""What the control plane reports: the states a replica goes through.

Shared by the manager's reconciler (control/), the replica's own metrics (replica/, metrics.py)
and what the CLI and the HTTP API print.
"""

from __future__ import annotations

import enum


class ReplicaState(enum.StrEnum):
    """Where a replica is in its life; a ``str``, so statuses read as plain strings too."""

    STARTING = "starting"  # placed or waiting for placement; the engine is loading
    READY = "ready"  # serving; health-checked
    DRAINING = "draining"  # out of the routing table; finishing its requests
    UNHEALTHY = "unhealthy"  # failed to start or a health check; being replaced
    STOPPED = "stopped"  # drained or given up; the reaper kills its actor

    @property
    def live(self) -> bool:
        """Counts toward the replica set (not on its way out)."""
        return self in (ReplicaState.STARTING, ReplicaState.READY)
