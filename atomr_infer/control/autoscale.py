"""Autoscaling decisions for one deployment: how many replicas its load calls for.

Ray Serve's rule (``serve/autoscaling_policy.py``) without its smoothing: the load is the
requests in flight on the ready replicas (each replica's last health answer) plus those waiting
in routers for a replica (routers report them while they wait); the deployment wants
``ceil(load / target_ongoing_requests)`` replicas within ``[min_replicas, max_replicas]`` and
moves there once that want has held for ``upscale_delay_s`` (more) or ``downscale_delay_s``
(fewer). From zero replicas a waiting request scales up at once: nothing can serve it.

Scaling up never breaks the budget: ``cap(n)`` answers how many of ``n`` replicas the budget
allows and why not more; the decision stops there and the reason stays visible in status (a
spend limit with ``on_exceeded: warn`` stops nothing: the decision's reason says it went over).
Pure: the clock and the budget come in as arguments, so tests drive it step by step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from atomr_infer.spec import Autoscaling

# A router's report of requests waiting counts this long (routers repeat it while they wait).
DEMAND_FRESH_S = 2.0
# cap(n) -> (replicas the budget allows, up to n; why not more, or a warning the budget lets pass
# (a spend limit with on_exceeded: warn), or None)
BudgetCap = Callable[[int], tuple[int, str | None]]


def within_bounds(replicas: int, cfg: Autoscaling) -> int:
    """``replicas`` moved inside ``[min_replicas, max_replicas]``."""
    return min(max(replicas, cfg.min_replicas), cfg.max_replicas)


@dataclass(frozen=True)
class ScaleDecision:
    at: float  # epoch seconds
    from_replicas: int
    to_replicas: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.to_replicas > self.from_replicas else "down"


class Autoscaler:
    def __init__(self, target: int) -> None:
        self.target = target  # the replica count the reconciler converges to
        self.load = 0.0  # as of the last decision
        self.wanted = target  # what the load called for, before delays and the budget
        self.limited: str | None = None  # why the budget stopped scaling short of ``wanted``
        self.last: ScaleDecision | None = None
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._waiting: dict[str, tuple[float, int]] = {}  # router id -> (reported at, waiting)

    def report_waiting(self, router_id: str, waiting: int, now: float) -> None:
        self._waiting[router_id] = (now, waiting)

    def waiting(self, now: float) -> int:
        self._waiting = {k: v for k, v in self._waiting.items() if now - v[0] < DEMAND_FRESH_S}
        return sum(n for _, n in self._waiting.values())

    def rebound(self, cfg: Autoscaling, now: float | None = None) -> ScaleDecision | None:
        """New bounds (a changed spec): the current target moved inside them; a decision (in
        status, as ``last``) where it moved and ``now`` is given (an apply, not a recovery)."""
        moved = within_bounds(self.target, cfg)
        if moved == self.target or now is None:
            self.target = moved
            return None
        return self._move(self.target, moved, f"the bounds changed to {cfg.min_replicas}-{cfg.max_replicas}", now)

    def decide(self, cfg: Autoscaling, in_flight: int, now: float, cap: BudgetCap) -> ScaleDecision | None:
        """One look at the load; a decision when the target changes."""
        waiting = self.waiting(now)
        self.load = float(in_flight + waiting)
        wanted = math.ceil(self.load / cfg.target_ongoing_requests)
        self.wanted = wanted = within_bounds(wanted, cfg)
        current = self.target
        if wanted > current:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            delay = 0.0 if current == 0 else cfg.upscale_delay_s
            if now - self._up_since < delay:
                return None
            allowed, why = cap(wanted)
            self.limited = why if allowed < wanted else None
            if allowed <= current:
                return None
            reason = (
                f"cold start: {waiting} request(s) waiting" if current == 0
                else f"load {self.load:g} over {current} replica(s) above target {cfg.target_ongoing_requests:g} "
                f"each for {delay:g}s"
            )
            if why and allowed < wanted:
                reason += f"; stopped short of {wanted}: {why}"
            elif why:
                reason += f"; {why}"
            return self._move(current, allowed, reason, now)
        self._up_since = None
        self.limited = None
        if wanted < current:
            self._down_since = now if self._down_since is None else self._down_since
            if now - self._down_since < cfg.downscale_delay_s:
                return None
            idle = "no load" if self.load == 0 else f"load {self.load:g}"
            return self._move(
                current, wanted, f"{idle} for {cfg.downscale_delay_s:g}s, target {cfg.target_ongoing_requests:g} "
                f"per replica", now,
            )
        self._down_since = None
        return None

    def _move(self, current: int, to: int, reason: str, now: float) -> ScaleDecision:
        self.target = to
        self._up_since = self._down_since = None
        self.last = ScaleDecision(now, current, to, reason)
        return self.last

    def report(self, cfg: Autoscaling, now: float) -> dict[str, Any]:
        """What ``atomr status`` shows under autoscaling."""
        return {
            "min_replicas": cfg.min_replicas,
            "max_replicas": cfg.max_replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests,
            "target_replicas": self.target,
            "wanted_replicas": self.wanted,
            "load": self.load,
            "waiting": self.waiting(now),
            "limited_by_budget": self.limited,
            "last_decision": asdict(self.last) if self.last else None,
        }
