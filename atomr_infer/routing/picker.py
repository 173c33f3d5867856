"""Which ready replica a request goes to, by the deployment's ``routing`` settings, and why.

``ReplicaPicker`` holds what a router remembers between requests to decide: the prompt prefixes
it sent where (one ``PrefixIndex`` per deployment, and per adapter, since vLLM caches per
adapter) and the count of each reason it picked for. Policies: ``power_of_two`` (policy.py),
``prefix_affinity`` (prefix.py), a LoRA adapter's home (adapters.py), alone or with a prefix.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping
from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.metrics import RouterMetrics
from atomr_infer.routing.adapters import pick_adapter_home
from atomr_infer.routing.policy import pick_replica
from atomr_infer.routing.prefix import PrefixIndex, pick_prefix_affinity
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute

log = get_logger(__name__)


class ReplicaPicker:
    def __init__(self) -> None:
        self._prefixes: collections.defaultdict[str, PrefixIndex] = collections.defaultdict(PrefixIndex)
        self.reasons: collections.Counter[tuple[str, str]] = collections.Counter()  # (deployment, reason)
        self._metrics: RouterMetrics | None = None  # built on first use: inside Ray, they are exported

    @property
    def metrics(self) -> RouterMetrics:
        if self._metrics is None:
            self._metrics = RouterMetrics()
        return self._metrics

    def pick(
        self, dep: DeploymentRoute, usable: list[ReplicaRoute], loads: Mapping[str, int], key: Callable[[], Any],
        adapter: str | None = None,
    ) -> ReplicaRoute | None:
        """The replica of ``usable`` (each with its ``loads``) for a request for ``adapter`` (None:
        the base model) whose prompt key ``key`` gives (read only where a policy needs it); None
        when every one is full."""
        if adapter is not None and dep.adapter_affinity:  # its home: fewer adapters per replica, fewer swaps
            home = functools.partial(pick_adapter_home, usable, loads, dep.max_concurrent, adapter, dep.load_bound)
            if dep.policy != "prefix_affinity":
                choice, reason = home()
            else:  # a prefix cached with this adapter (vLLM's cache is per adapter), else its home
                choice, reason = pick_prefix_affinity(usable, loads, dep.max_concurrent, key(),
                                                      self._prefixes[f"{dep.name}:{adapter}"], dep.load_bound, home)
        elif dep.policy != "prefix_affinity":
            return pick_replica(usable, loads, dep.max_concurrent)
        else:
            choice, reason = pick_prefix_affinity(
                usable, loads, dep.max_concurrent, key(), self._prefixes[dep.name], dep.load_bound
            )
        if choice is not None:
            self.reasons[dep.name, reason] += 1
            self.metrics.routed(dep.name, reason)
            log.debug("route", deployment=dep.name, replica=choice.actor_name, reason=reason)
        return choice  # type: ignore[return-value]
