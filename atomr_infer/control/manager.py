"""``DeploymentManager``: the control plane, a detached named Ray actor (``atomr-manager``).

``apply`` validates, checks budgets and records the desired state; it does not start
anything itself. A reconcile loop (every ``RECONCILE_PERIOD_S`` and at once after each
change) converges actual replicas to desired, one non-blocking pass at a time, each
deployment in its own try so one failure never stops the loop. Applies are serialized by a
lock; the generation rises only when the normalized spec's hash changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

from atomr_infer import heavy_imports
from atomr_infer.cluster import MANAGER_NAME
from atomr_infer.control.budget import BudgetVerdict, ClusterView, scaling_summary
from atomr_infer.control.budget_checks import BudgetChecks
from atomr_infer.control.cluster_view import ray_cluster_view
from atomr_infer.control.managed import ManagedDeployment, budgeted, removal_record
from atomr_infer.control.placement import GpuChoice
from atomr_infer.control.plan import (
    ApplyResult,
    Plan,
    PlanResult,
    check_names,
    plan_apply,
    plan_remove,
    shared_adapter_names,
)
from atomr_infer.control.reconcile import DeploymentReconciler, ReconcileConfig
from atomr_infer.control.recovery import Recovery
from atomr_infer.control.replicas import ReplicaLauncher
from atomr_infer.control.store import StateStore
from atomr_infer.engine.backend import backend_class
from atomr_infer.log import get_logger
from atomr_infer.metrics import ManagerMetrics
from atomr_infer.routing.table import RoutingTable
from atomr_infer.spec import Deployment, parse_deployment, spec_hash
from atomr_infer.status import DeploymentStatus

log = get_logger(__name__)
RECONCILE_PERIOD_S = 1.0
RECOVERY_WAIT_S = 30.0


class DeploymentManager:
    """The control plane. Create through ``atomr_infer.manager()``; every method is idempotent."""

    def __init__(self, launcher: ReplicaLauncher | None = None, store: StateStore | None = None,
                 cluster: ClusterView | None = None, reconcile_config: ReconcileConfig | None = None,
                 clock: Any = time.time) -> None:
        heavy_imports.watch("manager")  # it must load neither torch nor vLLM (heavy_imports.py)
        self._cluster_override = cluster
        self._gpu_choice = GpuChoice(self._cluster_view)
        self._launcher = launcher or self._ray_launcher()
        self._store = store or StateStore()
        self._clock = clock
        self._cfg = reconcile_config or ReconcileConfig()
        self._desired: dict[str, ManagedDeployment] = {}
        self._budgets = BudgetChecks(self._desired, self._cluster_view)
        self._removing: dict[str, DeploymentReconciler] = {}
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        # Versions start from the clock (µs): a restarted manager reuses no version routers may have cached.
        self._table = RoutingTable(version=time.time_ns() // 1_000)
        self._table_changed = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._metrics = ManagerMetrics()
        self._recovery = Recovery(self._store, self._clock, RECOVERY_WAIT_S)  # routers keep their tables meanwhile
        self._recover()
        self._publish()
        self._start_loop_soon()

    def __repr__(self) -> str:
        return MANAGER_NAME

    # -- helpers -----------------------------------------------------------------------------

    def _ray_launcher(self) -> ReplicaLauncher:
        from atomr_infer.control.ray_replicas import RayReplicaLauncher

        return RayReplicaLauncher(self._gpu_choice)

    def _cluster_view(self) -> ClusterView:
        return self._cluster_override if self._cluster_override is not None else ray_cluster_view()

    def _new_reconciler(self, name: str, next_index: int = 0) -> DeploymentReconciler:
        return DeploymentReconciler(name, self._launcher, self._clock, dataclasses.replace(self._cfg), next_index)

    @staticmethod
    def _start_loop_soon() -> None:
        """Inside Ray, call ourselves once so the reconcile loop starts without waiting for a
        client: a restarted manager must replace dead replicas even if nobody calls it.
        (``__init__`` runs before the actor's event loop, so the task cannot start here.)"""
        try:
            import ray

            if ray.is_initialized():
                current = ray.get_runtime_context().current_actor
                current.ping.remote()
        except Exception:  # noqa: BLE001 - outside an actor: the first call starts the loop
            pass

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    def _save(self) -> None:
        """Save the state now, or (the store not answering: a GCS blip) on a later pass: every pass
        saves. An apply or remove is done once in memory; its caller is not told it failed."""
        try:
            self._persist()
        except Exception as exc:  # noqa: BLE001
            log.error("state_save_failed", error=repr(exc))

    def _persist(self) -> None:
        removing = {name: removal_record(r) for name, r in self._removing.items()}
        self._recovery.save({**removing, **{name: d.synced_record() for name, d in self._desired.items()}})

    def _recover(self) -> None:
        """Rebuild desired state from the store and re-adopt live replicas by name."""
        pending = set(self._recovery.pending)
        recovered = self._recovery.recover(self._new_reconciler, self._launcher, self._clock)
        for name, managed, reconciler in recovered:
            if managed is None:  # refused by this version: its replicas are stopped, as a removal's
                self._removing[name] = reconciler
            else:
                self._desired[name] = managed
        if recovered or set(self._recovery.pending) != pending:  # (the store read, or a deployment recovered)
            self._publish()  # every deployment, some with no replica (scaled to zero); withheld while recovering

    # -- the loop ----------------------------------------------------------------------------

    async def _run_loop(self) -> None:
        while True:
            self.reconcile_once()
            self._kick.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), RECONCILE_PERIOD_S)

    def reconcile_once(self) -> None:
        """One pass over every deployment; safe to call any number of times."""
        started = time.perf_counter()
        routes_changed = False
        if not self._recovery.done:
            self._recover()
        for name, managed in self._desired.items():
            try:
                self._autoscale(name, managed)
            except Exception as exc:  # noqa: BLE001 - a failed look at the load never stops the loop
                log.error("autoscale_failed", deployment=name, error=repr(exc))
        self._budgets.check_surges()
        for name, rec in [(n, d.reconciler) for n, d in self._desired.items()] + list(self._removing.items()):
            try:
                routes_changed |= rec.update()
            except Exception as exc:  # noqa: BLE001 - one deployment never stops the loop
                log.error("reconcile_failed", deployment=name, error=repr(exc))
        for name in [n for n, r in self._removing.items() if r.finished_removing]:
            del self._removing[name]
            self._gpu_choice.forget(name)
            routes_changed = True
        routes_changed |= self._recovery.settled()  # its adopted replicas answered: the table lists them (or not)
        reap = getattr(self._launcher, "reaper", None)
        if reap is not None:
            reap.reap()
        if routes_changed:
            self._publish()
        self._save()
        self.last_reconcile_s = time.perf_counter() - started
        self._metrics.reconcile_pass(self.last_reconcile_s)

    def _autoscale(self, name: str, managed: ManagedDeployment) -> None:
        decision = managed.autoscale(self._clock(), self._budgets.autoscale_cap(managed))
        self._metrics.target(name, managed.autoscaler.target if managed.autoscaler is not None else None)
        if decision is None:
            return
        log.info("autoscale", deployment=name, replicas_from=decision.from_replicas,
                 replicas_to=decision.to_replicas, reason=decision.reason)
        self._metrics.scaled(name, decision.direction)

    def _publish(self) -> None:
        deployments = {name: d.route() for name, d in self._desired.items()}
        self._table = RoutingTable(self._table.version + 1, self._recovery.routes() | deployments)
        self._table_changed.set()
        self._table_changed = asyncio.Event()

    # -- messages ----------------------------------------------------------------------------

    async def apply(self, spec: Deployment | dict[str, Any]) -> ApplyResult:
        """Record ``spec`` as desired (after validation and budget checks); idempotent."""
        self._ensure_loop()
        try:
            deployment = parse_deployment(spec)
        except Exception:
            self._metrics.applied(str(spec.get("name", "")) if isinstance(spec, dict) else "", "rejected")
            raise
        async with self._lock:
            try:
                self._recovery.check(deployment.name)
            except Exception:
                self._metrics.applied(deployment.name, "rejected")
                raise
            current = self._desired.get(deployment.name)
            plan = self._plan(deployment, current)
            if not plan.changed:
                assert current is not None
                if current.reconciler.gave_up:  # failed: applying it again is the way to retry
                    action = _retry_action(current)
                    self._metrics.applied(deployment.name, "changed")
                    current.reconciler.retry()
                    self._kick.set()
                    log.info("apply", deployment=deployment.name, actions=action)
                    return ApplyResult(deployment.name, True, current.record.generation, (action,))
                self._metrics.applied(deployment.name, "unchanged")
                if failed := current.reconciler.retry_adapters():  # "fix lora.adapters and deploy again"
                    action = f"retry the adapters that failed to load ({', '.join(failed)})"
                    self._publish()  # routers wait for them again, instead of failing their requests
                    self._kick.set()
                    log.info("apply", deployment=deployment.name, actions=action)
                    return ApplyResult(deployment.name, False, current.record.generation, (action,))
                return ApplyResult(deployment.name, False, current.record.generation, ("unchanged",))
            try:
                others = self._budgets.others(deployment.name)
                check_names(deployment, others)
                verdict = self._budgets.check(budgeted(deployment, current), current, plan.restart, others, True)
                self._check_engine_args(deployment)
            except Exception as exc:
                self._metrics.applied(deployment.name, "rejected")
                log.info("apply_rejected", deployment=deployment.name, error=str(exc))
                raise
            self._record(deployment, current, plan)
            self._metrics.applied(deployment.name, "changed")
            generation = self._desired[deployment.name].record.generation
        log.info("apply", deployment=deployment.name, generation=generation, actions=plan.summary)
        self._kick.set()
        warnings = verdict.warnings + tuple(shared_adapter_names(deployment, others))
        return ApplyResult(deployment.name, True, generation, tuple(a.summary for a in plan.actions), warnings)

    async def plan(self, spec: Deployment | dict[str, Any], alongside: tuple[Any, ...] = ()) -> PlanResult:
        """What ``apply`` would do, and the budget verdict; changes nothing. Raises what apply
        would for the spec's names and vLLM settings. ``alongside``: specs applied with it (as
        if recorded first: ``atomr deploy`` of several files checks them all before any apply)."""
        deployment = parse_deployment(spec)
        self._recovery.check(deployment.name)
        batch = [parse_deployment(s) for s in alongside]
        others = self._budgets.others(deployment.name, batch)
        current = self._desired.get(deployment.name)
        plan = self._plan(deployment, current)
        failed = current if not plan.changed and current is not None and current.reconciler.gave_up else None
        if plan.changed:
            check_names(deployment, others)
            self._check_engine_args(deployment)
        error, checked = None, budgeted(deployment, current)
        try:
            verdict = (self._budgets.check(checked, current, plan.restart, others, True) if plan.changed
                       else BudgetVerdict(()))
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            error = str(exc)
            verdict = self._budgets.check(checked, current, plan.restart, others, False)
        actions = (_retry_action(failed),) if failed else tuple(a.summary for a in plan.actions)  # apply retries it
        scaling = ""
        if deployment.autoscaling is not None:
            cluster = self._cluster_view()
            held = self._budgets.held(current, plan.restart, cluster)
            cap = self._budgets.scale_cap(deployment, checked.replicas, deployment.autoscaling.max_replicas, cluster,
                                          held, batch)
            scaling = scaling_summary(deployment, cluster, cap)
        return PlanResult(deployment.name, plan.changed or failed is not None, actions, verdict.ok and error is None,
                          str(verdict), error, scaling)

    async def remove(self, name: str) -> ApplyResult:
        """Drain and stop a deployment's replicas. Unknown names are a no-op that says so."""
        self._ensure_loop()
        async with self._lock:
            self._recovery.check(name)
            current = self._desired.pop(name, None)
            plan = plan_remove(current.spec if current else None, name)
            if current is None:
                return ApplyResult(name, False, 0, tuple(a.summary for a in plan.actions))
            generation = current.record.generation + 1
            current.reconciler.set_desired(None, generation, "")
            self._metrics.target(name, None)
            self._removing[name] = current.reconciler
            self._save()
            self._publish()  # stop routing to it at once
        log.info("remove", deployment=name, actions=plan.summary)
        self._kick.set()
        return ApplyResult(name, True, generation, tuple(a.summary for a in plan.actions))

    async def list(self) -> list[DeploymentStatus]:
        """Every deployment (those being removed too); ``NotRecoveredYet`` while a restarted
        manager cannot read its stored state (it does not know them yet)."""
        self._ensure_loop()
        self._recovery.check_read()
        held = [self._status(n) for n in set(self._desired) | set(self._removing)]
        return sorted(held + self._recovery.statuses(), key=lambda s: s.name)

    async def status(self, name: str) -> DeploymentStatus | None:
        """``name``'s status, None if there is no such deployment; ``NotRecoveredYet`` as ``list``."""
        self._ensure_loop()
        self._recovery.check_read()
        return self._status(name) if name in self._desired or name in self._removing else self._recovery.status(name)

    async def routing_table(self, since_version: int = -1, timeout_s: float = 0.0) -> RoutingTable | None:
        """The current table if newer than ``since_version``; waits up to ``timeout_s`` for one. None
        while a restarted manager has not heard its adopted replicas answer (routers keep theirs)."""
        self._ensure_loop()
        if (self._table.version == since_version or self._recovery.withheld) and timeout_s > 0:
            try:
                await asyncio.wait_for(self._table_changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                return None
        return self._table if self._table.version != since_version and not self._recovery.withheld else None

    async def wait_ready(self, name: str, timeout_s: float = 600.0) -> DeploymentStatus | None:
        """Wait until ``name`` has converged (observed = desired generation), failed, or ``timeout_s`` passes."""
        self._ensure_loop()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self._status(name) if name in self._desired else None
            if status is None:
                if self._recovery.unread is None and name not in self._recovery.pending:  # (not recovered yet: waited)
                    return None
            elif (status.converged and status.adapters_settled) or status.failed:
                return status
            await asyncio.sleep(0.2)
        self._recovery.check_read()
        return self._status(name) if name in self._desired else self._recovery.status(name)

    async def report_demand(self, router_id: str, name: str, waiting: int) -> None:
        """A router's requests waiting for a replica of ``name`` (a name or an alias): load for
        the autoscaler, and what starts a deployment scaled to zero."""
        self._ensure_loop()
        route = self._table.find(name)
        managed = self._desired.get(route.name if route else name)
        if managed is None or managed.autoscaler is None:
            return
        managed.autoscaler.report_waiting(router_id, waiting, self._clock())
        if managed.autoscaler.target == 0 and waiting > 0:
            self._kick.set()  # a cold start: decide now, not at the next period

    async def node_id(self) -> str:
        """The Ray node the manager runs on (the head's, when created by ``manager_handle``)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    async def process_report(self) -> dict[str, Any]:
        """This process: its pid, and torch or vLLM if loaded (with the stack that imported
        each): only replicas should load them."""
        import os

        return {"pid": os.getpid(), "heavy_imports": heavy_imports.loaded()}

    async def ping(self) -> str:
        self._ensure_loop()
        return "ok"

    # -- internals ---------------------------------------------------------------------------

    def _plan(self, spec: Deployment, current: ManagedDeployment | None) -> Plan:
        force = current is not None and spec.restart_on_apply
        return plan_apply(current.spec if current else None, spec, force, current.reconciler.want if current else None)

    @staticmethod
    def _check_engine_args(spec: Deployment) -> None:
        # The backend's own check, which loads no engine here (this process lives long).
        backend_class(spec).validate(spec)

    def _record(self, spec: Deployment, current: ManagedDeployment | None, plan: Plan) -> None:
        if current is None:
            removing = self._removing.pop(spec.name, None)
            # Re-created while the old replicas drain: the same reconciler, the next generation.
            generation = removing.generation + 1 if removing is not None else 1
            reconciler = removing or self._new_reconciler(spec.name)
            self._desired[spec.name] = ManagedDeployment.create(spec, reconciler, generation)
        else:
            current.update(spec, plan.restart and spec.restart_on_apply, self._clock())
        self._save()
        self._publish()  # serving limits take effect at once

    def _status(self, name: str) -> DeploymentStatus:
        d = self._desired.get(name)
        status = (d.reconciler if d else self._removing[name]).status()
        scaling = None
        if d is not None and d.autoscaler is not None and d.spec.autoscaling is not None:
            scaling = d.autoscaler.report(d.spec.autoscaling, self._clock())
        return dataclasses.replace(
            status, removing=d is None, spec_hash=spec_hash(d.spec) if d else None, autoscaling=scaling,
            placement=d.spec.placement if d else None,
        )


def _retry_action(failed: ManagedDeployment) -> str:
    """What applying a failed deployment's spec again does (``plan`` says it too)."""
    return f"retry after failure ({failed.reconciler.last_failure})"
