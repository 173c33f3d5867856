"""Autoscaling decisions for one deployment: how many replicas its load calls for.

Ray Serve's default policy (``serve/autoscaling_policy.py``, its scaling factors at 1): the load
is the requests in flight on the ready replicas (each replica's last health answer) plus those
waiting in routers for a replica (routers report them while they wait), looked at every pass and
averaged over ``look_back_period_s``, each look holding until the next (``LoadWindow``, as Ray
Serve's time-weighted mean of its metrics). The deployment wants ``ceil(mean / target_ongoing_requests)``
replicas within ``[min_replicas, max_replicas]`` and moves to what the mean wants then once it has
wanted more for ``upscale_delay_s``, or fewer for ``downscale_delay_s``, pass after pass (Ray
Serve's decision counter: a pass that wants the current count, or the other way, starts it over).
One look alone never decides: a burst or a dip shorter than the window moves the mean by its share.
From zero replicas a waiting request scales up at once, to what the requests waiting now want:
nothing can serve them, and the mean still holds the idle past.

Scaling up never breaks the budget: ``cap(n)`` answers how many of ``n`` replicas the budget
allows and why not more; the decision stops there and the reason stays visible in status (a
spend limit with ``on_exceeded: warn`` stops nothing: the decision's reason says it went over).
Pure: the clock and the budget come in as arguments, so tests drive it step by step.
"""

from __future__ import annotations

import math
from collections import deque
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


class LoadWindow:
    """The load as a step function of time (each look holds until the next), and its mean."""

    def __init__(self) -> None:
        self._looks: deque[tuple[float, float]] = deque()  # (at, load), a new entry only where it changed

    def add(self, now: float, load: float) -> None:
        if self._looks and now <= self._looks[-1][0]:  # the same instant (or a clock set back): the newer look
            self._looks.pop()
        if not self._looks or self._looks[-1][1] != load:
            self._looks.append((now, load))

    def mean(self, now: float, period_s: float) -> float:
        """The time-weighted mean over the last ``period_s`` seconds, or since the first look where
        that is more recent (nothing is assumed before it); the last look where no time passed."""
        start = now - period_s
        while len(self._looks) > 1 and self._looks[1][0] <= start:
            self._looks.popleft()  # the one before the window still holds at its start
        if not self._looks:
            return 0.0
        begin = max(start, self._looks[0][0])
        if now <= begin:
            return self._looks[-1][1]
        ends = [at for at, _ in self._looks][1:] + [now]
        looks = zip(self._looks, ends, strict=True)
        total = sum(load * max(0.0, min(end, now) - max(at, begin)) for (at, load), end in looks)
        return total / (now - begin)


def _num(x: float) -> str:
    return f"{round(x, 2):g}"


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
        self.load = 0.0  # what the last decision read: the mean over the look-back window
        self.wanted = target  # what the load called for, before delays and the budget
        self.limited: str | None = None  # why the budget stopped scaling short of ``wanted``
        self.last: ScaleDecision | None = None
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._waiting: dict[str, tuple[float, int]] = {}  # router id -> (reported at, waiting)
        self._window = LoadWindow()

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
        self._window.add(now, float(in_flight + waiting))
        mean = self._window.mean(now, cfg.look_back_period_s)  # (every pass: it drops the looks past the window)
        current = self.target
        # At zero the requests waiting now decide (a cold start); else the mean over the window.
        self.load = float(in_flight + waiting) if current == 0 else mean
        # (- 1e-9: a mean summed to 4.0000000001 wants 2 replicas at 2 each, not 3)
        wanted = math.ceil(self.load / cfg.target_ongoing_requests - 1e-9)
        self.wanted = wanted = within_bounds(wanted, cfg)
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
                else f"load {_num(self.load)} over {current} replica(s) above target {cfg.target_ongoing_requests:g} "
                f"each for {delay:g}s (mean over {cfg.look_back_period_s:g}s)"
            )
            if why and allowed < wanted:
                reason += f"; stopped short of {wanted}: {why}"
            elif why:
                reason += f"; {why}"
            if current == 0:  # the idle window before it is no load to scale the start back down on
                self._window = LoadWindow()
                self._window.add(now, self.load)
            return self._move(current, allowed, reason, now)
        self._up_since = None
        self.limited = None
        if wanted < current:
            self._down_since = now if self._down_since is None else self._down_since
            if now - self._down_since < cfg.downscale_delay_s:
                return None
            idle = "no load" if self.load == 0 else f"load {_num(self.load)} (mean over {cfg.look_back_period_s:g}s)"
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
            "load": round(self.load, 2),
            "waiting": self.waiting(now),
            "limited_by_budget": self.limited,
            "last_decision": asdict(self.last) if self.last else None,
        }
