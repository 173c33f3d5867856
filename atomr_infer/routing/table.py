"""The versioned routing table the manager publishes and every router caches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplicaRoute:
    replica_id: str
    actor_name: str  # "atomr:<deployment>:<replica-id>", unique cluster-wide
    actor: Any  # Ray actor handle (picklable)
    adapters: frozenset[str] = frozenset()  # the LoRA adapters loaded on it (only these route here)
    adapters_loading: frozenset[str] = frozenset()  # lora.adapters it has not loaded yet (nor failed to)
    adapters_failed: tuple[tuple[str, str], ...] = ()  # lora.adapters it failed to load: (name, why)
    # Where it publishes its KV-cache events: (endpoint, replay endpoint, block size); None: it does not.
    kv_events: tuple[str, str | None, int] | None = None
    # The model it serves (spec.model): a kv_events router matches it only by the ids of that
    # model's tokenizer (a roll may change the model).
    model: str = ""
    # What its server renders chats with beyond the model's files (a chat template, default
    # template arguments), as a fingerprint: a roll that changes it changes the router's tokenizer.
    renders: str = ""


@dataclass(frozen=True)
class DeploymentRoute:
    name: str
    max_concurrent: int
    on_capacity_exhausted: str  # "queue" | "reject"
    replicas: tuple[ReplicaRoute, ...] = ()  # ready replicas only
    aliases: tuple[str, ...] = ()  # serving.openai.served_model_name: more names it answers to
    requests_per_minute: int | None = None  # serving.rate_limits, enforced by the HTTP ingress
    tokens_per_minute: int | None = None
    # autoscaling.cold_start_timeout_s when it may scale to zero: how long a request waits for a
    # replica to start (routers report waiting requests, which starts one).
    cold_start_timeout_s: float | None = None
    policy: str = "power_of_two"  # routing.policy
    load_bound: float = 1.25  # routing.load_bound (prefix_affinity)
    adapters: tuple[str, ...] = ()  # lora.adapters: requested as "<name>:<adapter>"
    adapter_affinity: bool = True  # routing.adapter_affinity
    migration_tries: int = 2  # serving.migration.max_tries; 0: not enabled
    parses_output: bool = False  # vLLM parses the output (a reasoning parser, Harmony): streams move only unstarted
    model: str = ""  # spec.model, the one a roll goes to: kv_events tokenizes with its tokenizer
    # A deployment a restarted manager has not recovered yet (its replicas not looked up): routers
    # keep routing it by their last table's route (RoutingTable.keeping).
    recovering: bool = False


@dataclass(frozen=True)
class RoutingTable:
    version: int
    deployments: dict[str, DeploymentRoute] = field(default_factory=dict)

    def keeping(self, older: RoutingTable) -> RoutingTable:
        """This table, with each deployment it lists as ``recovering`` routed as ``older`` routed
        it, where that had replicas: they were serving before the manager restarted."""
        kept = {name: older.deployments[name] for name, dep in self.deployments.items()
                if dep.recovering and name in older.deployments and older.deployments[name].replicas}
        return dataclasses.replace(self, deployments={**self.deployments, **kept}) if kept else self

    def find(self, name: str) -> DeploymentRoute | None:
        """The deployment called ``name`` (or answering to it as an alias), also as the part of
        ``"<deployment>:<adapter>"`` before the colon, or the one deployment with an adapter of
        that bare name."""
        return self.resolve(name)[0]

    def resolve(self, name: str) -> tuple[DeploymentRoute | None, str | None]:
        """The deployment and the LoRA adapter (None: the base model) a request's ``model`` names:
        a deployment or alias; ``"<deployment>:<adapter>"``; or an adapter's bare name where one
        deployment alone has it (as vLLM names adapters). The adapter may not exist: routing says so."""
        found = self._named(name)
        if found is not None:
            return found, None
        base, colon, adapter = name.partition(":")
        if colon and (found := self._named(base)) is not None:
            return found, adapter
        having = self.adapter_of(name)
        return (self.deployments[having[0]], name) if len(having) == 1 else (None, None)

    def adapter_of(self, name: str) -> list[str]:
        """The deployments with a LoRA adapter of the bare name ``name``, by name."""
        return sorted(key for key, d in self.deployments.items() if name in d.adapters)

    def knows(self, name: str) -> bool:
        """Whether it has the deployment (and the adapter) ``name`` names: else a newer table may."""
        dep, adapter = self.resolve(name)
        return dep is not None and (adapter is None or adapter in dep.adapters)

    def _named(self, name: str) -> DeploymentRoute | None:
        found = self.deployments.get(name)
        if found is None:
            found = next((d for d in self.deployments.values() if name in d.aliases), None)
        return found
