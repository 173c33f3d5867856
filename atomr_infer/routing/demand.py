"""What a router tells the manager of the requests it could not place on a replica: the
autoscaler's load beyond what the replicas report in flight, and, for a deployment scaled to
zero, what starts a replica.

Two kinds count: requests waiting for a replica, while they wait; and requests refused because
every replica was full (``on_capacity_exhausted: reject``, or a queue wait past
``queue_timeout_s``), for ``REFUSED_COUNTS_S`` after each: they never wait, and without them a
deployment answering 429 looked no busier than its full replicas (with ``target_ongoing_requests``
at or above ``max_concurrent``, it never scaled up, or even scaled down).

The manager keeps a router's last report for ``autoscale.DEMAND_FRESH_S``. Reports go at most
every ``DEMAND_EVERY_S`` while there is demand, and once more, at once, when the waiting is over:
else the last count stayed, and counted again the same requests the replicas then reported in
flight.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
from typing import Any

from atomr_infer.log import get_logger

# How often a router reports, while requests wait for a replica, how many wait.
DEMAND_EVERY_S = 0.5
# How long a refused request counts in the reports: about one report's worth (a client that
# retries is counted again when it is refused again).
REFUSED_COUNTS_S = 1.0
# demand(router id, deployment, waiting): sends the report without waiting for an answer
# (``manager.report_demand.remote``).
DemandReport = Callable[[str, str, int], Any]
log = get_logger(__name__)


class Demand:
    """One router's demand, by deployment, and its reports of it."""

    def __init__(self, router_id: str, report: DemandReport | None) -> None:
        self._id, self._report = router_id, report
        self.waiting: collections.Counter[str] = collections.Counter()  # requests waiting, by deployment
        self._refused: dict[str, collections.deque[float]] = {}  # deployment -> when each was refused
        self._sent: dict[str, tuple[float, int]] = {}  # deployment -> (when, what) it last reported
        self._trailing: set[str] = set()  # deployments with a report held back, sent when it may go

    def wait(self, name: str) -> None:
        """One more request waits for a replica of ``name``."""
        self.waiting[name] += 1

    def waited(self, name: str, now: float) -> None:
        """A request no longer waits (routed, failed or gone); the last to stop waiting says so."""
        self.waiting[name] -= 1
        if not self.waiting[name]:
            self.report(name, now, final=True)

    def refused(self, name: str, now: float) -> None:
        """A request for ``name`` refused: every replica was full."""
        self._refused.setdefault(name, collections.deque()).append(now)
        self.report(name, now)

    def count(self, name: str, now: float) -> int:
        refused = self._refused.get(name)
        while refused and now - refused[0] >= REFUSED_COUNTS_S:
            refused.popleft()
        return self.waiting[name] + len(refused or ())

    def report(self, name: str, now: float, final: bool = False) -> None:
        """Tell the manager, if the last report is ``DEMAND_EVERY_S`` old; ``final``: at once, if
        the count changed (the waiting is over)."""
        if self._report is None:
            return
        at, last = self._sent.get(name, (-math.inf, 0))
        count = self.count(name, now)
        if final and count == last:
            return
        if not final and now - at < DEMAND_EVERY_S:
            if count > last:  # held back: a burst refused within one period would count as its first
                self._trail(name, at + DEMAND_EVERY_S - now)
            return
        self._sent[name] = (now, count)
        try:
            self._report(self._id, name, count)
        except Exception as exc:  # noqa: BLE001 - the manager is away: routing goes on
            log.warning("demand_report_failed", deployment=name, error=f"{type(exc).__name__}: {exc}")

    def _trail(self, name: str, delay_s: float) -> None:
        """Report ``name`` once ``delay_s`` is up (one pending at a time), on this event loop."""
        if name in self._trailing:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: the next report says it
            return
        self._trailing.add(name)

        def send() -> None:
            self._trailing.discard(name)
            self.report(name, time.monotonic())

        loop.call_later(max(0.0, delay_s), send)
