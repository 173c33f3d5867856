"""The manager's budget questions, asked over the deployments it holds (``control/budget.py``
answers them for given specs): the other deployments as a check counts them, apply's and plan's
check of one spec, how far the autoscaler may scale one, and whether a roll may surge.

A CPU deployment's own ready replicas already hold their memory, which the cluster's available
memory (psutil's, now) is net of: they are counted as holding it (``HeldMemory``), not against
it again; replicas still starting have not taken all of theirs yet and are counted as new.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from atomr_infer.control.autoscale import BudgetCap
from atomr_infer.control.budget import (
    BudgetVerdict,
    ClusterView,
    HeldMemory,
    check_budget,
    least_held_bytes,
    scale_cap,
    size_estimates,
    uses_gpus,
)
from atomr_infer.control.managed import ManagedDeployment, budgeted
from atomr_infer.control.placement import node_has_room
from atomr_infer.log import get_logger
from atomr_infer.spec import Deployment

log = get_logger(__name__)


class BudgetChecks:
    def __init__(self, desired: dict[str, ManagedDeployment], cluster_view: Callable[[], ClusterView]) -> None:
        self._desired = desired  # the manager's own dict: always its deployments now
        self._cluster_view = cluster_view

    def others(self, name: str, alongside: Iterable[Deployment] = ()) -> list[Deployment]:
        """The other deployments as the budget counts them: at their current replica targets (one
        scaled to zero at one: its next request starts one, which must still fit), those of
        ``alongside`` as they would be applied."""
        batch = {d.name: budgeted(d, self._desired.get(d.name)) for d in alongside if d.name != name}
        kept = [self._as_counted(d) for n, d in self._desired.items() if n != name and n not in batch]
        return kept + list(batch.values())

    @staticmethod
    def _as_counted(managed: ManagedDeployment) -> Deployment:
        """A deployment's spec at its replica target now, as the budget counts it."""
        return budgeted(managed.spec.model_copy(update={"replicas": managed.reconciler.want}), None)

    def check(self, spec: Deployment, current: ManagedDeployment | None, restart: bool, others: list[Deployment],
              raise_on_fail: bool) -> BudgetVerdict:
        """Apply's check of ``spec`` (as ``budgeted`` counts it), replacing ``current``'s
        replicas if ``restart`` (a roll), else keeping them."""
        cluster = self._cluster_view()
        weights, kv, max_len = size_estimates(spec, on_cpu=not uses_gpus(spec, cluster))
        held = self.held(current, restart, cluster)
        before = self._as_counted(current) if current is not None and self._on_gpus(current) else None
        return check_budget(spec, others, cluster, raise_on_fail, weights, kv, max_len, held, before=before)

    @staticmethod
    def _on_gpus(managed: ManagedDeployment) -> bool:
        """Whether its replicas hold GPUs: what it held that a lost node took (a ``device: auto``
        one ran on CPUs until a GPU node joined: its next apply asks for GPUs it never held)."""
        return managed.spec.device == "cuda" or any(r.handle.placement().get("gpu_ids")
                                                    for r in managed.reconciler.ready_replicas())

    def held(self, current: ManagedDeployment | None, restart: bool, cluster: ClusterView) -> HeldMemory:
        """What ``current``'s ready CPU replicas of its spec hold (nothing on GPUs): kept, or
        replaced by a roll, each freeing at least its weights and the KV cache it cannot run without."""
        if current is None or uses_gpus(current.spec, cluster):
            return HeldMemory()
        rec = current.reconciler
        holding = sum(1 for r in rec.ready_replicas() if r.runtime_key == rec.runtime_key)
        if not restart or not holding:
            return HeldMemory(holding)
        return HeldMemory(holding, True, least_held_bytes(current.spec, *size_estimates(current.spec, on_cpu=True)))

    def scale_cap(self, spec: Deployment, current: int, wanted: int, cluster: ClusterView | None = None,
                  held: HeldMemory | None = None, alongside: Iterable[Deployment] = ()) -> tuple[int, str | None]:
        """How far the budget lets ``spec`` scale from ``current`` towards ``wanted``, and why not further."""
        cluster = cluster or self._cluster_view()
        sizes = size_estimates(spec, on_cpu=not uses_gpus(spec, cluster))
        return scale_cap(spec, self.others(spec.name, alongside), cluster, current, wanted, sizes, held)

    def autoscale_cap(self, managed: ManagedDeployment) -> BudgetCap:
        """The autoscaler's cap from its target now; CPU memory counted for every replica not yet
        ready (a target climbed against the same free memory while its replicas loaded)."""
        target = managed.reconciler.want

        def cap(wanted: int) -> tuple[int, str | None]:
            cluster = self._cluster_view()
            return self.scale_cap(managed.spec, target, wanted, cluster, self.held(managed, False, cluster))

        return cap

    def room_for_one_more(self, managed: ManagedDeployment, cluster: ClusterView | None = None) -> bool:
        """Room for a roll's surge replica (else the roll is stop-first): in the budget, and on GPUs
        on a node now (the budget counts the old replicas at the new spec's GPUs: 2 → 1 on a full
        cluster started one no node could take, and the old replicas waited for it for good)."""
        want, cluster = managed.reconciler.want, cluster or self._cluster_view()
        cap, _why = self.scale_cap(managed.spec, want, want + 1, cluster)
        return cap > want and (not uses_gpus(managed.spec, cluster) or node_has_room({"GPU": managed.spec.gpus}))

    def check_surges(self) -> None:
        """Whether each roll may start a replica beyond its target: decided when it starts, and
        again when its target or the cluster's GPUs change (a scale-up took the spare GPU, a node
        was lost), not every pass: mid-roll, the replicas it drains still hold their GPUs."""
        cluster: ClusterView | None = None
        for name, managed in self._desired.items():
            rec = managed.reconciler
            if not rec.rolling:
                continue
            try:
                cluster = cluster or self._cluster_view()
                key = (rec.runtime_key, rec.want, cluster.total_gpus)
                if rec.surge_checked_for != key:
                    rec.surge_allowed, rec.surge_checked_for = self.room_for_one_more(managed, cluster), key
                    log.info("roll_surge", deployment=name, allowed=rec.surge_allowed, replicas=rec.want,
                             cluster_gpus=cluster.total_gpus)
            except Exception as exc:  # noqa: BLE001 - without an answer the roll surges as before
                rec.surge_allowed = True
                log.error("surge_check_failed", deployment=name, error=repr(exc))
