"""What the control plane reports: replica and deployment states, and the status objects
``manager.status``/``list`` return (read by the CLI, the HTTP API and Python users).

Shared by the manager's reconciler (control/), the replica's own metrics (replica/, metrics.py)
and what the CLI and the HTTP API print.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

# A LoRA adapter's state on a replica (``ReplicaStatus.adapters``; replica/adapters.py keeps it):
# loading, loaded, reloading (from a new source: its old weights still answer), or "failed: <why>".
ADAPTER_LOADING, ADAPTER_LOADED, ADAPTER_RELOADING = "loading", "loaded", "reloading"
ADAPTER_ROUTED = frozenset({ADAPTER_LOADED, ADAPTER_RELOADING})  # the states its requests are routed in


def adapter_failure(state: str) -> str | None:
    """Why the replica failed to load the adapter, for a ``failed: <why>`` state; else None."""
    return state.partition(": ")[2] if state.startswith("failed") else None


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


class DeploymentState(enum.StrEnum):
    """One word for where a deployment is (``atomr status``'s STATUS column)."""

    READY = "ready"  # converged: every desired replica ready on the current spec
    STARTING = "starting"  # its first generation is not ready yet
    ROLLING = "rolling"  # a later generation is replacing or scaling the replicas
    FAILING = "failing"  # replicas fail to start; the manager retries with backoff
    FAILED = "failed"  # a start failure recurred 3 times: nothing more starts until an apply
    SCALING = "scaling"  # the autoscaler moved the target; replicas start or drain to meet it
    COLD_START = "cold-start"  # scaled to zero, requests wait while its first replica starts
    IDLE = "idle"  # scaled to zero; the next request starts a replica
    REMOVING = "removing"  # removed: its replicas drain and stop
    RECOVERING = "recovering"  # a restarted manager has not recovered it yet (it tries every second)


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the manager sees it; placement and engine facts once it is ready."""

    replica_id: str  # r0, r1, ...
    actor_name: str  # atomr:<deployment>:<replica_id>
    state: ReplicaState
    generation: int  # the deployment generation it was started for
    reason: str | None = None  # why it is unhealthy or stopped
    in_flight: int = 0  # as of its last health check
    started_at: float = 0.0  # epoch seconds
    actor_id: str | None = None
    node_id: str | None = None
    gpu_ids: tuple[str, ...] = ()
    device: str | None = None
    dtype: str | None = None
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    routes: tuple[str, ...] = ()  # its server's routes for its model, "METHOD /path"
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> loading | loaded | failed: why
    kv_events: dict[str, Any] | None = None  # where it publishes KV-cache events (endpoint, replay, block size)
    model: str | None = None  # the spec's model it was started with (mid-roll: the old spec's or the new)
    max_model_len: int | None = None  # its engine's context length
    parses_output: bool = False  # vLLM parses every chat answer (Harmony: gpt-oss): its streams move only unstarted


@dataclass(frozen=True)
class DeploymentStatus:
    """What ``manager.status``/``list`` (and ``ControlPlane``) return for one deployment."""

    name: str
    model: str | None
    generation: int  # desired: rises with every changed apply
    observed_generation: int  # what the replicas have converged to
    replicas_desired: int
    replicas_ready: int
    replicas: tuple[ReplicaStatus, ...] = ()
    last_failure: str | None = None
    failure_kind: str | None = None  # "recurring" (the engine refused the spec) | "transient"
    failing: bool = False  # last_failure is current: no replica started since (it may be old history)
    failed: bool = False  # gave up: see DeploymentState.FAILED
    start_failures: int = 0  # recurring start failures since the last success
    next_start_in_s: float = 0.0  # backoff before the next start
    removing: bool = False
    recovering: bool = False  # stored, not recovered yet by a restarted manager (last_failure says why)
    spec_hash: str | None = None  # of the desired spec; None while removing
    placement: str | None = None  # "spread" | "pack"
    # With autoscaling: bounds, target, load, the last decision and what stopped it (budget).
    autoscaling: dict[str, Any] | None = None
    # Every ready replica has each of the spec's LoRA adapters loaded or failed (none loading, and
    # an in-place change heard): ``wait_ready`` and ``atomr deploy --wait`` wait for it too.
    adapters_settled: bool = True
    adapter_sources: dict[str, str] = field(default_factory=dict)  # the spec's lora.adapters: name -> source

    @property
    def failed_adapters(self) -> dict[str, str]:
        """Adapter -> why, for those a ready replica failed to load."""
        return {name: why for r in self.replicas if r.state == "ready"
                for name, state in r.adapters.items() if (why := adapter_failure(state)) is not None}

    @property
    def converged(self) -> bool:
        return self.observed_generation == self.generation

    @property
    def state(self) -> DeploymentState:
        if self.recovering:
            return DeploymentState.RECOVERING
        if self.removing:
            return DeploymentState.REMOVING
        if self.failed:
            return DeploymentState.FAILED
        if self.converged and self.replicas_ready == self.replicas_desired:
            return DeploymentState.IDLE if self.autoscaling and self.replicas_desired == 0 else DeploymentState.READY
        if self.failing and self.replicas_ready < self.replicas_desired:
            return DeploymentState.FAILING
        if self.autoscaling and self.converged:
            return DeploymentState.COLD_START if self.replicas_ready == 0 else DeploymentState.SCALING
        return DeploymentState.STARTING if self.generation == 1 else DeploymentState.ROLLING

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (``atomr status --json`` adds the replicas' live stats)."""
        data = dataclasses.asdict(self)
        data["status"] = str(self.state)
        data["failed_adapters"] = self.failed_adapters
        return data
