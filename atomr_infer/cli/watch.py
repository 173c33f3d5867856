"""``atomr deploy --wait``: follow deployments until they are ready, fail, or time runs out.

In a terminal a live table shows each replica's state and engine-start phase; elsewhere (a
pipe, CI, ``make demo`` logs) one line is printed per change, so the log reads as a story.
A deployment *fails* when a replica of it fails after the deploy began (its reason is
printed); the manager keeps retrying with backoff, which the error's hint says.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.text import Text

from atomr_infer.cli import common, render
from atomr_infer.cli.app import out
from atomr_infer.errors import AtomrError, one_line, unwrap
from atomr_infer.status import DeploymentStatus

POLL_S = 0.5
STATUS_TIMEOUT_S = 30.0
WAITING_AFTER_S = 5.0  # ask Ray why a replica is not placed only once placing it takes this long


@dataclass
class Outcome:
    ready: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # name -> reason
    recurring: list[str] = field(default_factory=list)  # failures that will recur: the manager stops retrying
    pending: list[str] = field(default_factory=list)  # still not ready at the timeout
    adapters: list[str] = field(default_factory=list)  # of ``failed``: ready, but LoRA adapters failed to load
    away: str | None = None  # why the manager did not answer when the time ran out


def _converged(s: DeploymentStatus) -> bool:
    return s.converged and s.replicas_ready == s.replicas_desired and s.adapters_settled


class _Watch:
    def __init__(self, manager: Any, names: list[str]) -> None:
        self.manager, self.names = manager, names
        self.started = time.monotonic()
        self.first: dict[str, DeploymentStatus | None] = {}
        self.seen: dict[str, str] = {}  # replica key -> last printed state line
        self.waiting: dict[str, str] = {}  # actor name -> why it is not placed yet
        self.away: str | None = None  # why the last poll had no answer from the manager

    def poll(self) -> tuple[list[DeploymentStatus], dict[str, Any]] | None:
        """The statuses and their replicas' stats; None while the manager restarts or recovers its
        state (``away`` says so): the rollout goes on without it, and the next poll asks again."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

        try:
            found = ray.get([self.manager.status.remote(n) for n in self.names], timeout=STATUS_TIMEOUT_S)
        except ActorUnavailableError:  # (a RayActorError too)
            self.away = "the atomr manager is restarting"
            return None
        except RayActorError:  # the call was under way when it died: Ray restarts it (max_restarts=-1)
            self.away = "the atomr manager died; waiting for Ray to restart it"
            return None
        except GetTimeoutError:
            self.away = f"the atomr manager did not answer within {STATUS_TIMEOUT_S:g}s"
            return None
        except RayTaskError as exc:
            if not isinstance(cause := unwrap(exc), AtomrError) or not cause.retryable:  # NotRecoveredYet is
                raise
            self.away = one_line(cause)
            return None
        self.away = None
        statuses = [s for s in found if s is not None]
        replicas = [r for s in statuses for r in s.replicas]
        stats = common.replica_stats(replicas, timeout_s=1.0)
        if time.monotonic() - self.started > WAITING_AFTER_S:  # placing an actor takes a moment
            self.waiting = common.waiting_reasons(replicas, stats)
        return statuses, stats

    def failure(self, s: DeploymentStatus) -> str | None:
        """A failure that happened after the deploy began, else None. (A deployment a restarted
        manager has not recovered yet says why, and that is no failure of the rollout.)"""
        before = self.first.get(s.name)
        last = s.last_failure
        if last and not s.recovering and (before is None or last != before.last_failure):
            return last
        return None

    def lines(self, statuses: list[DeploymentStatus], stats: dict[str, Any]) -> list[Text]:
        rows = render.replica_rows(statuses, stats, {}, None, waiting=self.waiting)
        elapsed = time.monotonic() - self.started
        out_lines = render.deployments_lines(statuses)
        if rows:
            out_lines += [Text("")] + _progress_lines(rows)
        out_lines.append(Text(f"waiting {elapsed:.0f}s", style="dim"))
        return out_lines

    def changes(self, statuses: list[DeploymentStatus], stats: dict[str, Any]) -> list[str]:
        """Lines for what changed since the last poll (non-terminal output)."""
        news = []
        for r in render.replica_rows(statuses, stats, {}, None, waiting=self.waiting):
            key = f"{r['deployment']}/{r['replica']}"
            if r["state"] == "starting" and r.get("phase") == "ready":
                continue  # the engine is up; the manager marks it ready on its next pass
            phase = r.get("phase") if r["state"] == "starting" and r.get("phase") not in (None, "ready") else None
            text = r["state"] + (f": {phase}" if phase else "")
            if r.get("reason") and r["state"] in ("unhealthy", "stopped"):
                text += f": {r['reason']}"
            if self.seen.get(key) != text:
                self.seen[key] = text
                news.append(f"  {key}  {text}  ({time.monotonic() - self.started:.0f}s)")
        return news


def _progress_lines(rows: list[dict[str, Any]]) -> list[Text]:
    cells: list[list[render.Cell]] = []
    for r in rows:
        phase = r.get("phase") or ""
        if r["state"] in ("unhealthy", "stopped"):
            phase = r.get("reason") or ""
        cells.append([f"{r['deployment']}/{r['replica']}", r["state"], phase, render.age(r["uptime_s"])])
    return render.columns(["REPLICA", "STATE", "PHASE", "AGE"], cells)


def wait_for(manager: Any, names: list[str], timeout_s: float) -> Outcome:
    """Follow ``names`` until each is ready or failed, or ``timeout_s`` passes. While the manager
    restarts (or recovers its state) the watch says so and asks again: the rollout goes on."""
    watch = _Watch(manager, names)
    deadline = time.monotonic() + timeout_s
    outcome = Outcome(pending=list(names))
    live = Live(console=out, auto_refresh=False, transient=False) if out.is_terminal else None
    said_away = None
    try:
        if live is not None:
            live.start()
        first = None
        for turn in itertools.count():
            polled = watch.poll()
            if polled is None:
                if live is not None:
                    live.update(Text(f"waiting: {watch.away}", style="dim"), refresh=True)
                elif watch.away != said_away:
                    out.print(f"  waiting: {watch.away}", markup=False, emoji=False)
                said_away = watch.away
                if time.monotonic() >= deadline:
                    return dataclasses.replace(outcome, away=watch.away)
                time.sleep(POLL_S)
                continue
            said_away = None
            statuses, stats = polled
            if first is None:  # (as the deploy began: what failed before is not this rollout's failure)
                first = watch.first = {s.name: s for s in statuses}
            by_name = {s.name: s for s in statuses}
            if turn == 0 and all(n in by_name and _converged(by_name[n]) and not by_name[n].failed_adapters
                                 for n in names):
                return Outcome(ready=list(names))  # nothing to follow: say nothing
            if live is not None:
                live.update(Group(*watch.lines(statuses, stats)), refresh=True)
            else:
                for line in watch.changes(statuses, stats):
                    out.print(line, markup=False, emoji=False)
            outcome = Outcome()
            for name in names:
                s = by_name.get(name)
                if s is None:
                    outcome.failed[name] = "removed while waiting"
                elif _converged(s) and s.failed_adapters:  # ready, but not all it was asked to serve
                    outcome.failed[name] = "; ".join(f"adapter {a!r} failed to load: {why}"
                                                     for a, why in sorted(s.failed_adapters.items()))
                    outcome.adapters.append(name)
                elif _converged(s):
                    outcome.ready.append(name)
                elif (reason := watch.failure(s)) is not None:
                    outcome.failed[name] = reason
                    if s.failed or s.failure_kind == "recurring":
                        outcome.recurring.append(name)
                else:
                    outcome.pending.append(name)
            if not outcome.pending or time.monotonic() >= deadline:
                return outcome
            time.sleep(POLL_S)
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        if live is not None:
            live.stop()
