"""Level-based reconciliation of one deployment: converge actual replicas to the desired spec.

``DeploymentReconciler.update()`` compares desired and actual on every pass and does the next
safe step; running it any number of times is harmless (Ray Serve's ``DeploymentState.update``).
Nothing here blocks or touches Ray directly: replica calls go through ``ReplicaLauncher`` /
``ReplicaHandle`` and time through an injected clock, so unit tests use fakes for both.

Rolling replacement: replicas running an old ``runtime_key`` are replaced with at most
``max_surge`` extra replicas at a time; an old replica is drained only once enough new ones
are ready, so the deployment keeps serving; with no room for one more (``surge_allowed``,
the manager's answer), it is stop-first, and a new replica Ray cannot place has an old replica
stopped for it. Scale-down stops the newest replicas first, so
the original replicas survive a 1 → 3 → 1 round trip. A replica that fails to start or dies
is replaced after an exponential backoff (1 s, 2 s, 4 s … 60 s), reset by the next success.
A start failure that will recur (the engine itself raised: a bad config, too little memory)
is tried ``max_start_failures`` times; then the deployment is ``failed`` and nothing more is
started until the spec changes or is applied again (``retry``). Transient failures (an actor
that died, a node that went away) keep backing off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atomr_infer.control.replicas import AdapterRoutes, ReplicaLauncher, ReplicaRecord, adapter_routes
from atomr_infer.log import get_logger
from atomr_infer.spec import Deployment
from atomr_infer.status import ADAPTER_LOADED, DeploymentStatus, ReplicaState, adapter_failure

log = get_logger(__name__)


@dataclass
class ReconcileConfig:
    max_surge: int = 1
    health_period_s: float = 2.0
    drain_timeout_s: float = 30.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    linger_s: float = 120.0  # stopped/unhealthy records stay visible in status this long
    max_start_failures: int = 3  # recurring start failures before the deployment is failed
    freed_wait_s: float = 15.0  # after a replica stops, Ray's "not placed" may be old (10 s) or about to change


class DeploymentReconciler:
    def __init__(
        self,
        name: str,
        launcher: ReplicaLauncher,
        clock: Callable[[], float],
        config: ReconcileConfig | None = None,
        next_index: int = 0,
    ) -> None:
        self.name = name
        self.spec: Deployment | None = None  # None: being removed
        self.generation = 0
        self.runtime_key = ""
        self.observed_generation = 0
        self.replicas: list[ReplicaRecord] = []
        self.replicas_wanted: int | None = None  # the autoscaler's target; None: the spec's replicas
        # False where the cluster has no room for one replica more (one GPU, held by the old
        # replica): a roll then stops an old replica before it starts its replacement. The
        # manager sets it from the budget while a roll is under way.
        self.surge_allowed = True
        self._freed_at = -1e9  # when a replica of it last stopped (what it held is free)
        self.surge_checked_for: tuple[str, int, float] | None = None  # (runtime key, want, cluster GPUs) decided for
        self.failures = 0
        self.recurring_failures = 0  # start failures that will recur, since the last success
        self.failure_kind = ""  # "recurring" | "transient", of the last failure
        self.next_start_at = 0.0
        self.last_failure = ""
        # A replica failed since one last started (or the spec last changed): the manager is retrying.
        # last_failure stays afterwards, as history; an old one is no reason to say "failing".
        self.failing = False
        self._failed_at = -1.0  # the clock of the last failure
        self.adapter_retry = 0  # retry_adapters' count; not persisted: replicas retry once more when it differs
        self._launcher, self._clock = launcher, clock
        self._cfg = config or ReconcileConfig()
        self._next_index = next_index
        self._log = log.bind(deployment=name)

    # -- desired state ---------------------------------------------------------------------

    def set_desired(self, spec: Deployment | None, generation: int, runtime_key: str) -> None:
        if generation != self.generation:
            self.retry()  # a changed spec may start where the old one could not
        if spec is not None and self.spec is None:  # re-created while removed: not the old one's failure
            self.last_failure = self.failure_kind = ""
            self.failing = False
        self.spec, self.generation, self.runtime_key = spec, generation, runtime_key

    def retry(self) -> None:
        """Start again after the deployment failed (or clear the failure count)."""
        if self.gave_up:
            self._log.info("deployment_retry", last_failure=self.last_failure)
        self.failures, self.recurring_failures, self.next_start_at = 0, 0, 0.0
        self.failing = False

    def drain_live(self) -> None:
        """Drain every live replica now, a starting one too: adopted by a restarted manager, it
        is STARTING until it answers, yet may serve a router's cached table (a removal's
        ``_retire`` would stop it at once, cutting what it runs)."""
        now = self._clock()
        for r in self.replicas:
            if r.live:
                self._drain(r, now)

    def _drain(self, r: ReplicaRecord, now: float) -> None:
        r.handle.begin_drain(self._cfg.drain_timeout_s)
        r.drain_deadline = now + self._cfg.drain_timeout_s + 5.0
        self._set_state(r, ReplicaState.DRAINING, now)

    def adopt(self, record: ReplicaRecord, draining: bool = False) -> None:
        """Take over a replica found alive after a manager restart; one that was draining drains
        on (and is then stopped: else it held its GPU, refusing requests, for good)."""
        self.replicas.append(record)
        if draining:
            self._drain(record, self._clock())
        index = int(record.replica_id.lstrip("r") or 0)
        self._next_index = max(self._next_index, index + 1)

    def skip_index(self, index: int) -> None:
        """Name no new replica below ``index`` (those names are taken)."""
        self._next_index = max(self._next_index, index)

    def stored_replicas(self) -> dict[str, dict[str, Any]]:
        """What a deployment's record keeps of its replicas: the live ones and those draining, for
        a restarted manager to adopt (and drain on)."""
        return {
            r.replica_id: {"runtime_key": r.runtime_key, "generation": r.generation, "started_at": r.started_at,
                           **({"draining": True} if r.state == ReplicaState.DRAINING else {})}
            for r in self.replicas
            if r.live or r.state == ReplicaState.DRAINING
        }

    @property
    def next_index(self) -> int:
        """The index the next new replica gets (``r<index>``): recorded, so that a restarted
        manager never reuses the name of a replica that may still be stopping."""
        return self._next_index

    @property
    def gave_up(self) -> bool:
        """Failed: a start failure recurred ``max_start_failures`` times; nothing more is started
        until the spec changes or is applied again."""
        return self.recurring_failures >= self._cfg.max_start_failures

    @property
    def finished_removing(self) -> bool:
        return self.spec is None and not any(r.live or r.state == ReplicaState.DRAINING for r in self.replicas)

    @property
    def want(self) -> int:
        """Replicas to converge to: the autoscaler's target, else the spec's ``replicas``."""
        if self.spec is None:
            return 0
        return self.spec.replicas if self.replicas_wanted is None else self.replicas_wanted

    def in_flight(self) -> int:
        """Requests open on the ready replicas, as of their last health checks."""
        return sum(r.handle.in_flight() for r in self.ready_replicas())

    @property
    def rolling(self) -> bool:
        """Replicas of an older runtime key are still live: a roll is under way."""
        return any(r.live and r.runtime_key != self.runtime_key for r in self.replicas)

    def ready_replicas(self) -> list[ReplicaRecord]:
        return [r for r in self.replicas if r.state == ReplicaState.READY]

    # -- the pass --------------------------------------------------------------------------

    def update(self) -> bool:
        """One reconcile pass. Returns True if what routers see changed: the ready replicas, or
        the LoRA adapters loaded on them."""
        before = self._routes()
        now = self._clock()
        self._poll(now)
        if self.spec is None:
            for r in self.replicas:
                if r.live:
                    self._retire(r, now)
        else:
            self._converge(self.spec, now)
        self._forget_old_records(now)
        if self._converged():
            self.observed_generation = self.generation
        return before != self._routes()

    def _routes(self) -> frozenset[tuple[str, AdapterRoutes]]:
        """What routers see of the ready replicas: their ids and the adapters loaded (still
        loading, failed) on them."""
        wanted = self._wanted_adapters() or {}
        return frozenset((r.replica_id, adapter_routes(r.handle, wanted, self.adapter_retry))
                         for r in self.ready_replicas())

    def _wanted_adapters(self) -> dict[str, str] | None:
        lora = self.spec.lora if self.spec is not None else None
        return dict(lora.adapters) if lora is not None else None

    def _poll(self, now: float) -> None:
        for r in self.replicas:
            if r.state == ReplicaState.STARTING:
                poll = r.handle.poll_ready()
                if poll.done and poll.ok and r.handle.answered_draining():  # adopted mid-drain: drains on, stops
                    self._drain(r, now)
                elif poll.done and poll.ok:
                    self._set_state(r, ReplicaState.READY, now)
                    # Its first health check at the next pass: its adapter states (it loaded them
                    # before it said ready) come with it, and requests for them route to it.
                    r.last_health_at = now - self._cfg.health_period_s
                    self.failures = self.recurring_failures = 0
                    self.failing = False
                elif poll.done:
                    self._fail(r, f"failed to start: {poll.reason}", now, poll.recurring)
            elif r.state == ReplicaState.READY and now - r.last_health_at >= self._cfg.health_period_s:
                # A replica still on an older spec (mid-roll) keeps its adapters: the new spec's may
                # need what its engine lacks (LoRA on, a higher rank, another base model).
                current = r.runtime_key == self.runtime_key
                poll = r.handle.poll_health(self._wanted_adapters() if current else None, self.adapter_retry)
                if poll.done:
                    r.last_health_at = now
                    if not poll.ok:
                        self._fail(r, poll.reason, now)
            elif r.state == ReplicaState.DRAINING:
                poll = r.handle.poll_drained()
                if poll.done or now >= r.drain_deadline:
                    r.handle.stop()
                    self._set_state(r, ReplicaState.STOPPED, now, "drained" if poll.done else "drain timed out")

    def _converge(self, spec: Deployment, now: float) -> None:
        want = self.want
        new = [r for r in self.replicas if r.live and r.runtime_key == self.runtime_key]
        old = [r for r in self.replicas if r.live and r.runtime_key != self.runtime_key]

        # Old replicas that are not serving yet go at once; they would only delay the roll.
        for r in [r for r in old if r.state == ReplicaState.STARTING and not r.unheard]:
            self._retire(r, now)
            old.remove(r)

        # Start what is missing, within the surge allowance and the failure backoff.
        surge = self._cfg.max_surge if old and self.surge_allowed else 0
        room = want + surge - len(new) - len(old)
        to_start = min(want - len(new), room)
        if to_start > 0 and now >= self.next_start_at and not self.gave_up:
            if self.failures:
                to_start = 1  # after a failure, probe with one replica at a time
            for _ in range(to_start):
                if not self._start(spec, now):
                    break
            new = [r for r in self.replicas if r.live and r.runtime_key == self.runtime_key]

        # No surge allowed (e.g. no spare GPU): replace one old replica at a time, stop-first.
        starting_new = [r for r in new if r.state == ReplicaState.STARTING]
        if room <= 0 and len(new) < want and not starting_new:
            self._retire_oldest(old, now)
        # A new replica Ray cannot place waits for what old replicas hold (the spare GPU a scale-up or
        # a lost node took): an old one stops for it and the roll goes stop-first; one at a time, once
        # no other new replica is loading and none draining (it frees what a waiting one needs).
        waiting = [r for r in starting_new if not r.made_room and r.handle.waiting_for()]
        draining = any(r.state == ReplicaState.DRAINING for r in self.replicas)
        draining |= now - self._freed_at < self._cfg.freed_wait_s  # or one just stopped: Ray's answer lags
        if waiting and len(waiting) == len(starting_new) and not draining and self._retire_oldest(old, now):
            waiting[0].made_room, self.surge_allowed = True, False

        # Old ready replicas leave only once the new ones can carry the load.
        ready_new = sum(1 for r in new if r.state == ReplicaState.READY)
        old_ready = sorted((r for r in old if r.state == ReplicaState.READY), key=lambda r: r.started_at)
        excess = ready_new + len(old_ready) - want
        for r in old_ready[: max(0, excess)]:
            self._retire(r, now)

        # Plain scale-down: stop starting replicas first, then the newest ready ones.
        if len(new) > want:
            order = sorted(new, key=lambda r: (r.state != ReplicaState.STARTING or r.unheard, -r.started_at))
            for r in order[: len(new) - want]:
                self._retire(r, now)

    def _retire_oldest(self, old: list[ReplicaRecord], now: float) -> bool:
        """Retire the longest-running ready replica of ``old`` (and drop it from the list)."""
        victims = sorted((r for r in old if r.state == ReplicaState.READY), key=lambda r: r.started_at)
        if victims:
            self._retire(victims[0], now)
            old.remove(victims[0])
        return bool(victims)

    def _start(self, spec: Deployment, now: float) -> bool:
        replica_id = f"r{self._next_index}"
        self._next_index += 1
        # Where the deployment's replicas are, so that a new one spreads or packs next to them:
        # those of the current spec (mid-roll, the old ones are about to go; counted, a roll
        # put every new replica beside them on the node with the most free GPUs).
        nodes = [r.handle.placement().get("node_id") for r in self.replicas
                 if r.live and r.runtime_key == self.runtime_key]
        try:
            handle = self._launcher.start(spec, replica_id, [n for n in nodes if n])
        except Exception as exc:  # noqa: BLE001 - a failed start is a replica failure, not a crash
            self._note_failure(f"{replica_id} could not be created: {exc}", now)
            self._log.error("replica_create_failed", replica=replica_id, error=str(exc))
            return False
        record = ReplicaRecord(replica_id, self.runtime_key, self.generation, handle, started_at=now, state_since=now)
        self.replicas.append(record)
        self._log.info("replica_state", replica=replica_id, state=ReplicaState.STARTING, generation=self.generation)
        return True

    def _retire(self, r: ReplicaRecord, now: float) -> None:
        if r.state == ReplicaState.READY or r.unheard:
            self._drain(r, now)
        elif r.state == ReplicaState.STARTING:
            r.handle.stop()
            self._set_state(r, ReplicaState.STOPPED, now, "no longer needed")

    def _fail(self, r: ReplicaRecord, reason: str, now: float, recurring: bool = False) -> None:
        r.handle.stop()
        self._set_state(r, ReplicaState.UNHEALTHY, now, reason)
        self._note_failure(f"{r.replica_id} {reason}", now, recurring)

    def _note_failure(self, reason: str, now: float, recurring: bool = False) -> None:
        if now != self._failed_at:  # replicas failing in one pass (their node lost) are one backoff step
            self.failures += 1
            delay = min(self._cfg.backoff_max_s, self._cfg.backoff_base_s * 2 ** (self.failures - 1))
            self.next_start_at = now + delay
        self._failed_at = now
        self.last_failure, self.failing = reason, True
        self.failure_kind = "recurring" if recurring else "transient"
        if recurring:
            self.recurring_failures += 1
            if self.recurring_failures == self._cfg.max_start_failures:
                self._log.error("deployment_failed", tries=self.recurring_failures, last_failure=reason)

    def _set_state(self, r: ReplicaRecord, state: ReplicaState, now: float, reason: str = "") -> None:
        r.state, r.reason, r.state_since = state, reason, now
        self._freed_at = now if state == ReplicaState.STOPPED else self._freed_at
        level = "warning" if state == ReplicaState.UNHEALTHY else "info"
        getattr(self._log, level)("replica_state", replica=r.replica_id, state=state, reason=reason or None)

    def _forget_old_records(self, now: float) -> None:
        linger = self._cfg.linger_s
        self.replicas = [
            r for r in self.replicas if r.live or r.state == ReplicaState.DRAINING or now - r.state_since < linger
        ]

    def _converged(self) -> bool:
        if self.spec is None:
            return self.finished_removing
        live = [r for r in self.replicas if r.live or r.state == ReplicaState.DRAINING]
        return len(live) == self.want and all(
            r.state == ReplicaState.READY and r.runtime_key == self.runtime_key for r in live
        )

    # -- reporting ---------------------------------------------------------------------------

    def _next_start_in(self) -> float:
        if not self.failures or self.gave_up:
            return 0.0
        return max(0.0, self.next_start_at - self._clock())

    def status(self) -> DeploymentStatus:
        spec = self.spec
        wanted_names = self._wanted_adapters() or {}  # one an apply removed is not listed while it unloads
        replicas = tuple(r.status(wanted_names)
                         for r in sorted(self.replicas, key=lambda r: int(r.replica_id.lstrip("r") or 0)))
        return DeploymentStatus(
            name=self.name,
            model=spec.model if spec else None,
            generation=self.generation,
            observed_generation=self.observed_generation,
            replicas_desired=self.want, replicas_ready=len(self.ready_replicas()),
            replicas=replicas,
            last_failure=self.last_failure or None,
            failure_kind=self.failure_kind or None,
            failing=self.failing,
            failed=self.gave_up,
            start_failures=self.recurring_failures,
            next_start_in_s=self._next_start_in(),
            adapters_settled=self._adapters_settled(),
            adapter_sources=wanted_names,
        )

    def retry_adapters(self) -> list[str]:
        """The spec's adapters a ready replica failed to load: its replicas try them again at once, not
        after their backoff, and say ``loading`` meanwhile (an unchanged apply asks it)."""
        wanted = self._wanted_adapters() or {}
        failed = {n for r in self.ready_replicas() for n, _ in adapter_routes(r.handle, wanted, self.adapter_retry)[2]}
        self.adapter_retry += bool(failed)
        return sorted(failed)

    def _adapters_settled(self) -> bool:
        """Every ready replica answered a health check that asked for the spec's adapters as they
        are now, with each loaded or failed (``atomr deploy --wait`` waits for that too)."""
        wanted = self._wanted_adapters()
        return not wanted or all(
            r.handle.adapters_asked(self.adapter_retry) == wanted
            and all(state == ADAPTER_LOADED or adapter_failure(state) is not None
                    for state in (r.handle.adapters().get(n, "") for n in wanted))
            for r in self.ready_replicas()
        )

