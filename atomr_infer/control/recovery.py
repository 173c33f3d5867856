"""A restarted manager's recovery of its stored state, which may take more than one pass.

The store may not answer yet (the GCS of a head that has just restarted), and looking up a
deployment's replicas by name may fail with a Ray error other than "no such actor". Either way
nothing is given up: what has not been recovered keeps its stored record, which every save
writes back as it was (a save of what the manager holds would drop it, and its replicas would
run on unmanaged: a re-apply then collides with their names); an apply or remove of it is refused
as retryable (as is a listing, while the store is unread); and every reconcile pass tries again.
"""

from __future__ import annotations

from collections.abc import Callable

from atomr_infer.control.managed import ManagedDeployment, recover_or_stop
from atomr_infer.control.reconcile import DeploymentReconciler
from atomr_infer.control.replicas import ReplicaLauncher, ReplicaRecord
from atomr_infer.control.store import DeploymentRecord, StateStore
from atomr_infer.errors import AtomrError, SpecError
from atomr_infer.log import get_logger
from atomr_infer.routing.table import DeploymentRoute
from atomr_infer.spec import parse_deployment
from atomr_infer.status import DeploymentStatus, ReplicaState

log = get_logger(__name__)


class NotRecoveredYet(AtomrError):
    """The manager restarted and has not recovered this deployment (or its state) yet."""

    retryable = True


class Recovery:
    def __init__(self, store: StateStore, clock: Callable[[], float], wait_s: float) -> None:
        self._store, self._clock = store, clock
        self.unread: str | None = "not read yet"  # why the store has not been read, if it has not
        self.pending: dict[str, DeploymentRecord] = {}  # stored, not recovered yet
        self._why: dict[str, str] = {}  # a pending deployment's last error
        self.adopted: list[ReplicaRecord] = []  # replicas adopted and not heard from yet (for wait_s at most)
        self._wait_s = wait_s
        self._deadline = clock() + wait_s

    @property
    def done(self) -> bool:
        return self.unread is None and not self.pending

    @property
    def withheld(self) -> bool:
        """Whether routers keep their tables: adopted replicas not heard from, the store not read,
        or (until the deadline) a deployment not recovered yet."""
        return bool(self.adopted) or self.unread is not None or (bool(self.pending) and self._clock() < self._deadline)

    def _wait_from_now(self) -> None:
        self._deadline = max(self._deadline, self._clock() + self._wait_s)

    def settled(self) -> bool:
        """True once, when the adopted replicas have all answered (or the deadline passed)."""
        if self.adopted and (self._clock() >= self._deadline
                             or all(r.state is not ReplicaState.STARTING for r in self.adopted)):
            self.adopted = []
            return True
        return False

    def check_read(self) -> None:
        """``NotRecoveredYet`` while the store is unread: the manager cannot say what is deployed
        (an empty answer would read as "nothing": ``atomr down`` then stopped none of the replicas)."""
        if self.unread is not None:
            raise NotRecoveredYet(f"the atomr manager restarted and cannot read its stored state yet ({self.unread}); "
                                  "it tries again every second: try again shortly")

    def check(self, name: str) -> None:
        """``NotRecoveredYet`` unless ``name`` may be applied or removed now."""
        self.check_read()
        if name in self.pending:
            raise NotRecoveredYet(f"the atomr manager restarted and has not recovered deployment {name!r} yet (its "
                                  "replicas could not be looked up); it tries again every second: try again shortly")

    def recover(
        self, new_reconciler: Callable[[str, int], DeploymentReconciler], launcher: ReplicaLauncher,
        clock: Callable[[], float],
    ) -> list[tuple[str, ManagedDeployment | None, DeploymentReconciler]]:
        """The stored deployments recovered by this try: (name, the deployment or None where this
        version refuses its spec, its reconciler); the rest stay pending."""
        if self.unread is not None:
            try:
                self.pending = self._store.load()
            except Exception as exc:  # noqa: BLE001 - the GCS not answering yet: the next pass tries again
                self.unread = f"{type(exc).__name__}: {exc}"
                log.error("state_load_failed", error=self.unread)
                return []
            self.unread = None
            self._wait_from_now()
        recovered = []
        for name, record in list(self.pending.items()):
            reconciler = new_reconciler(name, record.next_index)
            try:
                managed = recover_or_stop(record, reconciler, launcher, clock)
            except Exception as exc:  # noqa: BLE001 - Ray's, looking its replicas up: kept, tried again
                self._why[name] = f"{type(exc).__name__}: {exc}"
                log.error("deployment_not_recovered_yet", deployment=name, error=self._why[name])
                continue
            del self.pending[name]
            self._why.pop(name, None)
            recovered.append((name, managed, reconciler))
            if managed is not None:
                if reconciler.replicas:  # their wait runs from now, not from the manager's start
                    self._wait_from_now()
                self.adopted += (adopted := list(reconciler.replicas))
                log.info("deployment_recovered", deployment=name, generation=record.generation, adopted=len(adopted))
        return recovered

    def status(self, name: str) -> DeploymentStatus | None:
        """A pending deployment as ``atomr status`` shows it: as stored, ``recovering``, and why."""
        record = self.pending.get(name)
        if record is None:
            return None
        why = f"not recovered yet after a manager restart: its replicas could not be looked up ({self._why.get(name)})"
        return DeploymentStatus(name, record.spec.get("model"), record.generation, record.generation,
                                len(record.replicas), 0, last_failure=why, recovering=True)

    def routes(self) -> dict[str, DeploymentRoute]:
        """The deployments not recovered yet, as routing tables list them once they are no longer
        withheld: known (a request waits for a replica, it is not told there is no such model),
        with no replica the manager knows of, and ``recovering``, so that routers keep routing to
        the replicas their last table had, which may well be serving still."""
        routes = {}
        for name, record in self.pending.items():
            try:
                serving = parse_deployment(record.spec).serving
                routes[name] = DeploymentRoute(name, serving.max_concurrent, serving.on_capacity_exhausted,
                                               aliases=tuple(serving.openai.served_model_name), recovering=True)
            except SpecError:  # a spec this version refuses: it is recovered only to be stopped
                continue
        return routes

    def statuses(self) -> list[DeploymentStatus]:
        return [s for name in self.pending if (s := self.status(name)) is not None]

    def save(self, records: dict[str, DeploymentRecord]) -> None:
        """Save ``records`` with those still pending as they were stored; nothing while the
        store has not been read (a save then would replace what it holds)."""
        if self.unread is None:
            self._store.save({**self.pending, **records})
