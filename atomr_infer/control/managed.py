"""One deployment as the manager holds it, in one object: the desired spec, its record (what
is persisted: generation, runtime key, the next replica index, the replicas to re-adopt) and
its reconciler (what runs). The record is brought up to date from the reconciler here, and
only here, before it is saved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from atomr_infer.control.autoscale import Autoscaler, BudgetCap, ScaleDecision, within_bounds
from atomr_infer.control.reconcile import DeploymentReconciler
from atomr_infer.control.replicas import ReplicaLauncher, ReplicaRecord, adapter_routes
from atomr_infer.control.store import DeploymentRecord
from atomr_infer.errors import SpecError, one_line
from atomr_infer.log import get_logger
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute
from atomr_infer.spec import Deployment, normalized, parse_deployment, runtime_fields

log = get_logger(__name__)


def runtime_key(spec: Deployment, nonce: int) -> str:
    """Hash of what a running replica depends on (``spec.runtime_fields``) and the forced-restart
    count; a change means "replace the replicas"."""
    data = runtime_fields(spec)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    return f"{digest}:{nonce}"


def budgeted(spec: Deployment, current: ManagedDeployment | None) -> Deployment:
    """``spec`` as apply's budget check sees it: with the replicas it will run (an autoscaled one at
    its target now, not its starting ``replicas``), and at least one when it scales from zero (the
    first request starts one: a replica that can never fit is refused at apply, not at that request)."""
    checked = current.as_applied(spec) if current is not None else spec
    if checked.autoscaling is not None and checked.replicas == 0:
        return checked.model_copy(update={"replicas": 1})
    return checked


@dataclass
class ManagedDeployment:
    spec: Deployment
    record: DeploymentRecord
    reconciler: DeploymentReconciler = field(repr=False)
    autoscaler: Autoscaler | None = field(default=None, repr=False)

    @classmethod
    def create(cls, spec: Deployment, reconciler: DeploymentReconciler, generation: int = 1) -> ManagedDeployment:
        managed = cls(spec, DeploymentRecord(normalized(spec), generation, runtime_key(spec, 0)), reconciler)
        reconciler.set_desired(spec, generation, managed.record.runtime_key)
        managed._follow_autoscaling(spec.replicas)
        return managed

    def _follow_autoscaling(self, start_at: int, now: float | None = None) -> None:
        """Autoscaling on: the autoscaler owns the replica count (starting at ``start_at``, kept
        within the spec's bounds: a move is a decision of its own at ``now``); off: the spec's
        ``replicas`` does."""
        cfg = self.spec.autoscaling
        if cfg is None:
            self.autoscaler = None
        elif self.autoscaler is None:
            self.autoscaler = Autoscaler(start_at)
        self.reconciler.replicas_wanted = None
        if self.autoscaler is not None and cfg is not None:
            self.autoscaler.rebound(cfg, now)
            self.reconciler.replicas_wanted = self.autoscaler.target

    def autoscale(self, now: float, cap: BudgetCap) -> ScaleDecision | None:
        """One autoscaling look at the load (no-op without autoscaling); the reconciler follows."""
        cfg = self.spec.autoscaling
        if self.autoscaler is None or cfg is None:
            return None
        failed = self.reconciler.gave_up
        if failed:  # no replica more until applied again, but fewer still as the load falls
            cap = self._held(self.autoscaler.target, f"a replica failed to start: {self.reconciler.last_failure}")
        decision = self.autoscaler.decide(cfg, self.reconciler.in_flight(), now, cap)
        self.reconciler.replicas_wanted = self.autoscaler.target
        if failed and decision is not None and self.autoscaler.target <= len(self.reconciler.ready_replicas()):
            self.reconciler.retry()  # what failed to start is no longer wanted: a later scale-up tries again
        return decision

    @staticmethod
    def _held(replicas: int, why: str) -> BudgetCap:
        return lambda _wanted: (replicas, why)

    def as_applied(self, spec: Deployment) -> Deployment:
        """``spec`` with the replicas it would run once applied here (as ``update`` sets them):
        autoscaled already, the current target within the new bounds; else its own ``replicas``
        (turning autoscaling on starts the autoscaler there)."""
        cfg = spec.autoscaling
        if cfg is None or self.autoscaler is None:
            return spec
        return spec.model_copy(update={"replicas": within_bounds(self.reconciler.want, cfg)})

    def update(self, spec: Deployment, forced_restart: bool, now: float | None = None) -> None:
        """A changed spec: the next generation (a new runtime key if the replicas must restart)."""
        rec = self.record
        rec.nonce += 1 if forced_restart else 0
        rec.spec, rec.generation = normalized(spec), rec.generation + 1
        rec.runtime_key = runtime_key(spec, rec.nonce)
        self.spec = spec
        self.reconciler.set_desired(spec, rec.generation, rec.runtime_key)
        self._follow_autoscaling(self.reconciler.want, now)

    def synced_record(self) -> DeploymentRecord:
        """The record, with the reconciler's next replica index and its replicas (live and draining)."""
        self.record.next_index = self.reconciler.next_index
        self.record.replicas = self.reconciler.stored_replicas()
        self.record.autoscaled_replicas = self.autoscaler.target if self.autoscaler else None
        return self.record

    @classmethod
    def recover(
        cls, record: DeploymentRecord, reconciler: DeploymentReconciler, launcher: ReplicaLauncher,
        now: Callable[[], float],
    ) -> ManagedDeployment:
        """From a saved record (a restarted manager): the replicas still alive are re-adopted by name."""
        spec = parse_deployment(record.spec)
        reconciler.set_desired(spec, record.generation, record.runtime_key)
        adopt_replicas(record, reconciler, launcher, now)
        managed = cls(spec, record, reconciler)
        scaled = record.autoscaled_replicas
        managed._follow_autoscaling(scaled if scaled is not None else spec.replicas)
        return managed

    def _served_model(self, facts: dict[str, Any], runtime_key: str) -> str:
        """The model a replica serves, as it reported it; one started before replicas reported it
        (adopted after a manager restart) serves this spec's model if it runs this spec."""
        return facts.get("model") or (self.spec.model if runtime_key == self.record.runtime_key else "")

    def route(self) -> DeploymentRoute:
        """Its entry in the routing table: the ready replicas and the serving limits."""
        wanted = self.spec.lora.adapters if self.spec.lora is not None else {}
        placed = [(r, r.handle.placement()) for r in self.reconciler.ready_replicas()]
        retry = self.reconciler.adapter_retry
        ready = tuple(
            ReplicaRoute(r.replica_id, r.handle.actor_name, r.handle.actor(), *adapter_routes(r.handle, wanted, retry),
                         kv_events=kv_source(facts.get("kv_events")), model=self._served_model(facts, r.runtime_key),
                         renders=str((facts.get("kv_events") or {}).get("renders") or ""))
            for r, facts in placed
        )
        s = self.spec.serving
        aliases = tuple(s.openai.served_model_name)
        limits = s.rate_limits
        scaling = self.spec.autoscaling
        cold_start = scaling.cold_start_timeout_s if scaling is not None and scaling.min_replicas == 0 else None
        return DeploymentRoute(
            self.spec.name, s.max_concurrent, s.on_capacity_exhausted, ready, aliases,
            limits.requests_per_minute, limits.tokens_per_minute, cold_start,
            self.spec.routing.policy, self.spec.routing.load_bound,
            tuple(self.spec.lora.adapters) if self.spec.lora is not None else (),
            self.spec.routing.adapter_affinity,
            s.migration.max_tries if s.migration.enabled else 0,
            # A tool-call parser reads only requests with tools (which move only unstarted).
            s.openai.reasoning_parser is not None or any(facts.get("parses_output") for _, facts in placed),
            model=self.spec.model,
        )


def kv_source(reported: dict[str, Any] | None) -> tuple[str, str | None, int] | None:
    """A replica's KV-event endpoints as its engine facts reported them (None: it publishes none)."""
    if not reported or not reported.get("endpoint") or not reported.get("block_size"):
        return None
    return reported["endpoint"], reported.get("replay_endpoint"), int(reported["block_size"])


def adopt_replicas(
    record: DeploymentRecord, reconciler: DeploymentReconciler, launcher: ReplicaLauncher, now: Callable[[], float],
) -> None:
    """The record's replicas still alive, re-adopted by name into ``reconciler``. Any other live
    replica of the deployment is stopped: one named past its ``next_index`` was started after the
    last save (a pass saves at its end; what it runs is not known), and its name is skipped; one
    below it was being stopped when the manager went (stopping asks it to shut down; the kill that
    follows was the old manager's to do)."""
    for replica_id in sorted(set(launcher.replica_ids(reconciler.name)) - set(record.replicas)):
        stray = launcher.adopt(reconciler.name, replica_id)
        if stray is not None:
            log.warning("replica_not_recorded_stopped", deployment=reconciler.name, replica=replica_id)
            stray.stop()
        if replica_id[1:].isdigit():
            reconciler.skip_index(int(replica_id[1:]) + 1)
    for replica_id, info in sorted(record.replicas.items()):
        handle = launcher.adopt(reconciler.name, replica_id)
        if handle is not None:
            reconciler.adopt(
                ReplicaRecord(
                    replica_id, info["runtime_key"], info["generation"], handle,
                    started_at=info.get("started_at", 0.0), state_since=now(),
                ),
                draining=bool(info.get("draining")),
            )


def recover_or_stop(
    record: DeploymentRecord, reconciler: DeploymentReconciler, launcher: ReplicaLauncher, now: Callable[[], float],
) -> ManagedDeployment | None:
    """A stored deployment, recovered with its live replicas (a restarted manager). None if it
    was being removed, or if this version refuses its spec (``SpecError``): then its replicas,
    which the manager can neither route to nor manage, are adopted into ``reconciler`` and drained
    and stopped as a removal's are (they free their GPUs, and their names for a corrected apply),
    and the refusal is its last failure (``atomr status``) until they are gone. A Ray error
    adopting is raised (recovery.py tries again)."""
    refused: SpecError | None = None
    if not record.removing:
        try:
            parse_deployment(record.spec)
        except SpecError as exc:
            refused = exc
        if refused is None:
            return ManagedDeployment.recover(record, reconciler, launcher, now)
    adopt_replicas(record, reconciler, launcher, now)
    reconciler.set_desired(None, record.generation + 1, "")
    reconciler.drain_live()  # adopted: not heard ready yet, but maybe serving a router's cached table
    if refused is not None:
        reconciler.last_failure = f"not recovered: this version of atomr refuses its stored spec ({one_line(refused)})"
        reconciler.failing = True
        log.error("deployment_not_recovered", deployment=reconciler.name, error=str(refused),
                  stopping=len(reconciler.replicas))
    return None


def removal_record(reconciler: DeploymentReconciler) -> DeploymentRecord:
    """What is kept of a deployment being removed, while its replicas drain: them (a restarted
    manager drains and stops them), and its next replica index (a re-apply never reuses a name)."""
    return DeploymentRecord({}, reconciler.generation, "", next_index=reconciler.next_index,
                            replicas=reconciler.stored_replicas(), removing=True)
