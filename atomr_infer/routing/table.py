"""The versioned routing table the manager publishes and every router caches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplicaRoute:
    replica_id: str
    actor_name: str  # "atomr:<deployment>:<replica-id>", unique cluster-wide
    actor: Any  # Ray actor handle (picklable)


@dataclass(frozen=True)
class DeploymentRoute:
    name: str
    max_concurrent: int
    on_capacity_exhausted: str  # "queue" | "reject"
    replicas: tuple[ReplicaRoute, ...] = ()  # ready replicas only


@dataclass(frozen=True)
class RoutingTable:
    version: int
    deployments: dict[str, DeploymentRoute] = field(default_factory=dict)
