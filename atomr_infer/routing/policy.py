"""Power of two choices on in-flight counts (Ray Serve's ``pow_2_router``).

Sample two distinct replicas with room and send to the one with fewer requests in flight:
nearly as balanced as "least loaded" without every router herding onto the same replica.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from atomr_infer.routing.table import ReplicaRoute


def pick_replica(
    replicas: Sequence[ReplicaRoute],
    in_flight: Mapping[str, int],
    max_concurrent: int,
    rng: random.Random | None = None,
) -> ReplicaRoute | None:
    """A replica below ``max_concurrent`` by power-of-two choices, or None if all are full."""
    free = [r for r in replicas if in_flight.get(r.actor_name, 0) < max_concurrent]
    if not free:
        return None
    if len(free) == 1:
        return free[0]
    a, b = (rng or random).sample(free, 2)
    return a if in_flight.get(a.actor_name, 0) <= in_flight.get(b.actor_name, 0) else b
